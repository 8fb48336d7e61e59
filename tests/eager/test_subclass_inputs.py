"""Layer inputs that are tensor subclasses, in one process (a 1-rank gloo group for DTensor).

DTensor and AsyncCollectiveTensor inputs swap through their local tensor, exactly; a DTensor
that is user data stays; any other subclass stays, counted under ``SkipReason.SUBCLASS`` and
warned about once per layer; a step that swaps nothing warns once (Note: [Never a silent step]).
The real multi-rank setups are in ``tests/distributed``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import swap_pass
from swap_pass.runtime.freeing import local_tensor
from tests.eager.helpers import assert_clean

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
DIM, LAYERS = 16, 4


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Each block ends in an op that does not save its output: a saved output is one more
        # holder of a wrapper's local storage, and the input would stay (counted, warned).
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(),
                                                  nn.Linear(DIM, DIM)) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step(model: Stack, x: torch.Tensor, wrap) -> tuple[torch.Tensor, list, list[bool]]:
    """Forward from ``wrap(x)``, backward; the loss, the grads, whether each input was freed."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
             for layer in model.layers]
    out = model(wrap(x))
    freed = [local_tensor(t).untyped_storage().nbytes() == 0 for t in seen]
    for hook in hooks:
        hook.remove()
    loss = (out.full_tensor() if hasattr(out, "full_tensor") else out).square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], freed


def _dtensor(mesh):
    from torch.distributed.tensor import DTensor, Replicate
    return lambda x: DTensor.from_local(x * 2, mesh, [Replicate()])  # an activation


def _act(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return AsyncCollectiveTensor(x * 2)  # as a collective not waited for yet returns it


@pytest.mark.parametrize("kind", ["dtensor", "async_collective"])
def test_wrapper_inputs_swap_through_local_tensor(mesh, kind):
    x = torch.randn(4, DIM, requires_grad=True)
    wrap = _dtensor(mesh) if kind == "dtensor" else _act
    if kind == "dtensor":
        from torch.distributed.tensor import distribute_module
        ref, model = Stack(), Stack()
        distribute_module(ref, mesh)
        distribute_module(model, mesh)
    else:
        ref, model = Stack(), Stack()
    expected = _step(ref, x.detach().requires_grad_(), wrap)
    kept = x.detach().clone()
    handle = swap_pass.enable_swap_layer_input(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, no step warning
        got = _step(model, x.detach().requires_grad_(), wrap)
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))
    # The first layer's input is swapped too: it is an activation (made from x).
    assert got[2] == [True] * (LAYERS - 1) + [False]
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == LAYERS - 1
    assert stats.peak_device_bytes_released == (LAYERS - 1) * 4 * DIM * 4
    assert stats.skipped_bytes == {}
    assert torch.equal(x, kept)
    assert_clean()
    handle.remove()


def test_dtensor_user_data_stays(mesh):
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    model = Stack()
    distribute_module(model, mesh)
    handle = swap_pass.enable_swap_layer_input(model,
                                               layers=list(model.layers)[:1] + [nn.Identity()])
    data = torch.randn(4, DIM)
    kept = data.clone()
    dt = DTensor.from_local(data, mesh, [Replicate()])  # no grad: the user's batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle.layers[0](dt)
    assert swap_pass.swap_stats().swap_outs == 0
    assert swap_pass.swap_stats().skipped_bytes == {"user_data": 4 * DIM * 4}
    assert data.untyped_storage().nbytes() > 0 and torch.equal(data, kept)
    handle.remove()


def test_other_subclass_is_counted_and_warned_once_per_layer():
    from torch.testing._internal.two_tensor import TwoTensor
    model = Stack()
    handle = swap_pass.enable_swap_layer_input(model)
    x = torch.randn(4, DIM, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            t = x * 2
            model(TwoTensor(t, t.clone())).sum().backward()
    messages = [str(w.message) for w in caught]
    subclass = [m for m in messages if "(subclass)" in m]
    assert len(subclass) == LAYERS - 1, messages  # once per layer, not per step
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == 0
    assert stats.skips["subclass"] == 2 * (LAYERS - 1)
    assert stats.skipped_bytes["subclass"] == 2 * (LAYERS - 1) * 2 * 4 * DIM * 4
    step = [m for m in messages if "swapped 0" in m]
    assert len(step) == 1 and "'subclass'" in step[0], messages
    assert_clean()
    handle.remove()


def test_step_warning_is_silent_when_most_layers_swap():
    model = Stack()
    handle = swap_pass.enable_swap_layer_input(model)
    x = torch.randn(4, DIM)  # the first layer's input is user data: kept, counted, quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == LAYERS - 2 and stats.skips == {"user_data": 1}
    handle.remove()


class Parallel(Stack):
    """Every block reads the user's batch: every input is user data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def test_step_warning_names_the_reasons_and_rearms_on_reset():
    model = Parallel()
    handle = swap_pass.enable_swap_layer_input(model)
    x = torch.randn(4, DIM)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # once per model
                model(x).sum().backward()
        step = [str(w.message) for w in caught if "swapped 0" in str(w.message)]
        assert len(step) == 1 and "'user_data'" in step[0], step
        swap_pass.reset()  # warns again after a reset
    assert swap_pass.swap_stats().swap_outs == 0
    handle.remove()
