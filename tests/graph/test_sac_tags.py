"""``swap_backend`` honours the offload tags of torch's selective checkpointing.

The compiled model is compared with the same compile without swap (``torch.equal`` on the loss
and every gradient) and with the eager model without checkpointing; the forward graphs are
checked for the swap nodes, ``swap_stats()`` for the bytes moved.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.sac import has_offload_policies
from tests.test_sac import BLOCKS, HIDDEN, INNER, N, Stack, _assert_exact, _input, _policy

pytestmark = pytest.mark.skipif(
    not has_offload_policies(),
    reason=f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD / "
           "PREFER_CPU_OFFLOAD (torch 2.13 and later have them)")

SWAP_OUT = torch.ops.swap_pass.swap_out.default


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles the same ``forward`` anew: past Dynamo's recompile limit it would run
    eagerly, unswapped."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
# The tagged addmm outputs backward reads: each block's ``up`` (gelu's backward needs it); the
# ``down`` outputs feed only the residual add, whose backward reads nothing: not saved at all.
TAGGED = {"addmm", "addmm_2", "addmm_4"}


def _torch_sac_of(policy_fn):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


def _torch_sac(tag: str):
    return _torch_sac_of(_policy(tag))


def _step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n.replace("_orig_mod.", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def _on(device):
    """``Stack`` built with ``context_fn`` and the input, both on ``device``."""
    return (lambda context_fn=None: Stack(context_fn).to(device),
            _input().detach().to(device).requires_grad_())


def _swapped_out(backend) -> list[str]:
    """The names of the nodes the backend's forward graphs hand to ``swap_out``."""
    return [n.args[0].name for p in backend.partitions
            for n in p.forward.graph.find_nodes(op="call_function", target=SWAP_OUT)]


@pytest.mark.parametrize("tag", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
@pytest.mark.parametrize("contexts", ["torch", "swap_pass"])
def test_tagged_nodes_are_saved_and_swapped_beside_the_layer_inputs(tag, contexts, device):
    stack, x = _on(device)
    context_fn = (_torch_sac(tag) if contexts == "torch" else
                  functools.partial(swap_pass.selective_checkpoint_contexts, _policy(tag)))
    eager = _step(stack(), x)
    plain = _step(torch.compile(stack(context_fn), backend="aot_eager"), x)
    backend = swap_pass.make_swap_backend("aot_eager")
    got = _step(torch.compile(stack(context_fn), backend=backend), x)
    _assert_exact(plain, got)
    _assert_exact(eager, got)
    swapped = {s.name: s for p in backend.partitions for s in p.swapped}
    assert TAGGED <= set(swapped)  # every tagged addmm, beside the blocks' inputs
    assert set(_swapped_out(backend)) == set(swapped)
    assert {swapped[name].layer for name in TAGGED} == {f"blocks.{i}" for i in range(BLOCKS)}
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == sum(s.nbytes for s in swapped.values())
    assert sum(swapped[name].nbytes for name in TAGGED) == BLOCKS * N * INNER * 4
    assert stats.swapped_in_bytes == stats.swapped_out_bytes and stats.host_bytes_in_use == 0


def test_without_the_tags_the_same_compile_saves_fewer_of_them():
    backend = swap_pass.make_swap_backend("aot_eager")
    _step(torch.compile(Stack(_torch_sac("PREFER_RECOMPUTE")), backend=backend), _input())
    assert not TAGGED & set(_swapped_out(backend))


def test_budget_mode_swaps_the_tagged_nodes_too(device):
    stack, x = _on(device)
    plain = _step(torch.compile(stack(_torch_sac("MUST_CPU_OFFLOAD")), backend="aot_eager"), x)
    backend = swap_pass.make_swap_backend("aot_eager", memory_budget=1.0)
    got = _step(torch.compile(stack(_torch_sac("MUST_CPU_OFFLOAD")), backend=backend), x)
    _assert_exact(plain, got)
    assert TAGGED <= set(_swapped_out(backend))


class Head(torch.nn.Module):
    """A checkpointed linear whose output the compiled region also returns."""

    def __init__(self, context_fn) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.context_fn = context_fn

    def forward(self, x):
        y = checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=False,
                       context_fn=self.context_fn)
        return y, self.lin(x)


def _tag_tanh(tag: str):
    return _policy(tag, ops=(torch.ops.aten.tanh.default,))


def test_must_on_a_node_that_is_also_an_output_is_an_error_naming_the_op():
    model = torch.compile(Head(_torch_sac_of(_tag_tanh("MUST_CPU_OFFLOAD"))),
                          backend=swap_pass.make_swap_backend("aot_eager"))
    with pytest.raises(Exception, match=r"swap_pass.swap_backend: tanh \(aten.tanh.default\) is "
                                        r"tagged MUST_CPU_OFFLOAD but cannot be swapped: it is "
                                        r"also an output of the compiled region"):
        model(_input())


def test_prefer_on_a_node_that_is_also_an_output_falls_back_counted():
    x = _input()
    context_fn = _torch_sac_of(_tag_tanh("PREFER_CPU_OFFLOAD"))
    backend = swap_pass.make_swap_backend("aot_eager")
    with pytest.warns(RuntimeWarning, match="a compiled graph swaps nothing"), \
            pytest.warns(RuntimeWarning, match=r"aten.tanh.default\) stays on the device "
                                               r"\(offload_fallback\)"):
        y, z = torch.compile(Head(context_fn), backend=backend)(x)
    y_ref, z_ref = Head(context_fn)(x)
    assert torch.equal(y, y_ref) and torch.equal(z, z_ref)
    assert swap_pass.swap_stats().skipped_bytes["offload_fallback"] == N * HIDDEN * 4


def test_inside_no_swap_the_compiled_offloads_stay_on_the_device(device):
    stack, x = _on(device)
    plain = _step(torch.compile(stack(_torch_sac("MUST_CPU_OFFLOAD")), backend="aot_eager"), x)
    compiled = torch.compile(stack(_torch_sac("MUST_CPU_OFFLOAD")),
                             backend=swap_pass.make_swap_backend("aot_eager"))
    with swap_pass.no_swap():
        got = _step(compiled, x)
    _assert_exact(plain, got)
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 0 and stats.skipped_bytes["no_swap"] > 0



def test_inductor_partitions_with_the_tags_too(deterministic):
    x = _input()
    plain = _step(torch.compile(Stack(_torch_sac("MUST_CPU_OFFLOAD")), backend="inductor"), x)
    backend = swap_pass.make_swap_backend("inductor")
    got = _step(torch.compile(Stack(_torch_sac("MUST_CPU_OFFLOAD")), backend=backend), x)
    _assert_exact(plain, got)
    assert TAGGED <= {s.name for p in backend.partitions for s in p.swapped}
    assert swap_pass.swap_stats().swapped_out_bytes >= BLOCKS * N * INNER * 4


def test_every_layer_input_and_tag_chosen_is_swapped_or_counted(monkeypatch):
    """Four blocks under torch's own SAC contexts (every addmm MUST_CPU_OFFLOAD), layer-input mode:
    the partitioner saves each block's input and each tagged ``up`` output, and the last block's
    ``down`` output for the loss. Every saved tensor the layer-input rule or a tag chose is swapped
    or counted with its reason: the first block's input is the graph's input (user data), the
    last block's input is not chosen (the loss is computed after it)."""
    import tests.test_sac as sac

    monkeypatch.setattr(sac, "BLOCKS", 4)
    x = _input().detach().requires_grad_()
    plain = _step(torch.compile(Stack(_torch_sac("MUST_CPU_OFFLOAD")), backend="aot_eager"), x)
    swap_pass.reset()
    backend = swap_pass.make_swap_backend("aot_eager")
    got = _step(torch.compile(Stack(_torch_sac("MUST_CPU_OFFLOAD")), backend=backend), x)
    _assert_exact(plain, got)
    (partition,) = backend.partitions
    fw = partition.forward
    saved = [n for n in fw.graph.find_nodes(op="output")[0].args[0][1:]
             if isinstance(n, torch.fx.Node) and not n.name.startswith("primals")]
    # the forward's saved activations: one wait per swapped tensor, and the last block's input
    waits = [n for n in saved if n.target == torch.ops.swap_pass.wait.default]
    kept = [n.name for n in saved if n not in waits]
    swapped = {s.name for s in partition.swapped}
    assert len(waits) == len(swapped) == 7
    assert {"addmm", "addmm_2", "addmm_4", "addmm_6", "addmm_7"} <= swapped  # every saved tag
    assert len(kept) == 1  # blocks.3's input
    stats = swap_pass.swap_stats()
    assert stats.skips == {"user_data": 1}  # blocks.0's input: the graph's input
    assert stats.skipped_bytes == {"user_data": N * HIDDEN * 4}
    layer_inputs = swapped - {"addmm", "addmm_2", "addmm_4", "addmm_6", "addmm_7"}
    assert len(layer_inputs) + stats.skips["user_data"] == 4 - 1  # every block's input but the last
