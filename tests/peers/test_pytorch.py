"""PyTorch's own scenarios: save_on_cpu / saved_tensors_hooks (test_autograd.py) and the
activation-offloading graph pass, written for swap_pass's ways in.

Each test compares a few steps bitwise with the same model without swap and shows that bytes
left the device, or that the graph holds the swap nodes.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass import SmartSwap
from swap_pass.smart import SmartSwapConfig
from tests.peers.helpers import HIDDEN, BlockStack, LinearBlock, exact_steps, moved, twins

GROUP = 2 * 8 * HIDDEN * 4  # one block input


def _loss(model, batch):
    return model(batch[0])


def _batches(n: int = 3):
    return [(torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(i)),)
            for i in range(n)]


class Checkpointed(LinearBlock):
    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def test_swap_and_checkpoint():
    """test_autograd test_save_on_cpu_and_checkpoint: checkpointed blocks, inputs swapped."""
    ref, model = twins(lambda: BlockStack(block=Checkpointed))
    handle = swap_pass.enable_swap_layer_input(model)
    exact_steps(ref, model, _loss, _batches())
    assert moved() == 3 * GROUP
    handle.remove()


def test_user_saved_tensors_hooks_around_a_swapped_step():
    """test_autograd's saved_tensors_hooks tests: the user's pack/unpack hooks still run."""
    ref, model = twins(BlockStack)
    handle = swap_pass.enable_swap_layer_input(model)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t

    def unpack(t):
        unpacked.append(t.shape)
        return t

    def loss_of(m, batch):
        if m is ref:
            return m(batch[0])
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return m(batch[0])

    with pytest.warns(RuntimeWarning, match="shares its storage"):  # the inputs stay: below
        exact_steps(ref, model, loss_of, _batches())
    assert packed and len(unpacked) == len(packed)
    # The identity pack keeps the views autograd saved (F.linear's 2-D view of each block
    # input) where the walk cannot see them: each input stays, counted (Note: [Telling saved
    # aliases from kept ones]).
    assert moved() == 0
    assert swap_pass.swap_stats().skipped_bytes["shared_storage"] == 3 * 3 * GROUP
    handle.remove()


def test_save_on_cpu_around_a_swapped_step():
    """test_autograd test_graph_save_on_cpu: save_on_cpu and the layer-input swap together."""
    ref, model = twins(BlockStack)
    handle = swap_pass.enable_swap_layer_input(model)

    def loss_of(m, batch):
        if m is ref:
            return m(batch[0])
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            return m(batch[0])

    on_cpu = torch.empty(0).device.type == "cpu"
    with pytest.warns(RuntimeWarning, match="shares its storage") if on_cpu else nullcontext():
        exact_steps(ref, model, loss_of, _batches())
    # On CPU save_on_cpu packs a CPU tensor as itself (``tensor.cpu()`` is a no-op): its packed
    # views of each block input hold the storage, which therefore stays, counted. On an
    # accelerator it packs a copy and the inputs leave.
    if on_cpu:
        assert moved() == 0
        assert swap_pass.swap_stats().skipped_bytes["shared_storage"] == 3 * 3 * GROUP
    else:
        assert moved() == 3 * GROUP
    handle.remove()


def test_smart_swap_inside_user_hooks():
    """test_autograd's nested saved_tensors_hooks: SmartSwap's hooks stack over the user's."""
    ref, model = twins(BlockStack)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        with SmartSwap(model, memory_budget=0.5, config=SmartSwapConfig(min_swap_bytes=0)) as smart:
            exact_steps(ref, model, _loss, _batches(4), smart=smart)
    assert swap_pass.swap_stats().swapped_out_bytes > 0


def test_graph_pass_inserts_swap_nodes_and_is_exact():
    """The activation-offloading graph pass tests: nodes inserted, results equal to no offload."""
    ref, model = twins(BlockStack)
    gm = swap_pass.apply_swap_pass(fx.symbolic_trace(model))
    names = [n.name for n in gm.graph.nodes]
    assert sum("swap_pass_out" in n for n in names) == 3
    assert sum("swap_pass_release" in n for n in names) == 3
    exact_steps(ref, gm, _loss, _batches())
    assert moved() == 3 * GROUP


def test_wait_with_nothing_pending_returns_the_tensor():
    """PyTorch's ao.wait_tensor raises with no pending transfer; ours returns (see its
    docstring)."""
    t = torch.randn(4, 4)
    out = torch.ops.swap_pass.wait(t)
    assert torch.equal(out, t) and out.data_ptr() == t.data_ptr()
    host = torch.ops.swap_pass.swap_out(t)
    first = torch.ops.swap_pass.wait(host, t)
    again = torch.ops.swap_pass.wait(host, t)  # a retained graph's second backward does this
    assert torch.equal(first, t) and torch.equal(again, t)


@pytest.mark.slow
def test_compiled_backend_same_as_the_same_compile_without_swap():
    """The graph pass under torch.compile: equal to the same compile without swap."""
    ref, model = twins(lambda: BlockStack(block=Checkpointed))
    torch._dynamo.reset()
    compiled_ref = torch.compile(ref, backend="aot_eager", fullgraph=True)
    compiled = torch.compile(model, backend=swap_pass.make_swap_backend("aot_eager"),
                             fullgraph=True)
    exact_steps(compiled_ref, compiled, _loss, _batches(2))
    assert swap_pass.swap_stats().swapped_out_bytes > 0
    torch._dynamo.reset()
