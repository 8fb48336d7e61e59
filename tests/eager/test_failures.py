"""A runtime failure part-way through a step (a free the device refuses, a copy error, no device
memory for a copy back) leaves every layer input with its data, through every eager way in and
SmartSwap; after ``reset()`` the next step is bitwise equal to the same model without swap.

See Note: [All-or-nothing transitions] in ``swap_pass/runtime/group.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swap_pass
from swap_pass import SmartSwap, SmartSwapConfig
from swap_pass.runtime.freeing import is_guarded
from swap_pass.testing import InjectedFailure, inject_failures
from swap_pass.tools.models import LlamaStyleModel, make_batch
from tests.eager.helpers import CFG, SwapLlamaLayer


def _capture_layer_inputs(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's input as it arrives, and a clone of its values then."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(
            lambda _m, args: seen.append((args[0], args[0].detach().clone())))
    return seen


def _intact(seen: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return bool(seen) and all(
        not is_guarded(t) and t.untyped_storage().nbytes() >= t.nbytes and torch.equal(t, v)
        for t, v in seen)


def _exact_step(model: torch.nn.Module, ref: torch.nn.Module, seed: int = 1) -> None:
    ids, labels = make_batch(CFG, 2, 16, seed=seed)
    model(ids, labels).backward()
    ref(ids, labels).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def _pair(decorated: bool = False) -> tuple[LlamaStyleModel, LlamaStyleModel]:
    """A model and its twin without swap, same weights; ``decorated``: its layers are
    :class:`SwapLlamaLayer` (the MindSpeed-style decorators)."""
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=True)
    ref = copy.deepcopy(model)
    if decorated:
        model.layers = torch.nn.ModuleList(SwapLlamaLayer(CFG) for _ in range(CFG.num_layers))
        model.load_state_dict(ref.state_dict())
    return model, ref


@pytest.mark.parametrize("kind", ["free", "copy", "host_alloc"])
def test_enable_a_failure_in_forward_keeps_every_layer_input(kind):
    model, ref = _pair()
    handle = swap_pass.enable_swap_layer_input(model)
    seen = _capture_layer_inputs(model)
    ids, labels = make_batch(CFG, 2, 16, seed=0)
    with inject_failures(**{kind: 2}) as injected, pytest.raises(InjectedFailure):
        model(ids, labels)
    assert injected.fired == [kind] and _intact(seen)
    swap_pass.reset()
    assert _intact(seen)
    seen.clear()
    _exact_step(model, ref)
    assert swap_pass.swap_stats().swap_outs > 0
    handle.remove()


def test_enable_a_failed_copy_back_in_backward_keeps_the_data_until_reset():
    model, _ = _pair()
    handle = swap_pass.enable_swap_layer_input(model)
    seen = _capture_layer_inputs(model)
    ids, labels = make_batch(CFG, 2, 16, seed=0)
    loss = model(ids, labels)
    assert any(t.untyped_storage().nbytes() == 0 for t, _ in seen)  # swapped out
    with inject_failures(allocate=1), pytest.raises(InjectedFailure):
        loss.backward()
    swap_pass.reset()  # restores what backward could not
    assert _intact(seen)
    handle.remove()


def test_decorated_layers_a_failed_free_keeps_every_layer_input():
    model, ref = _pair(decorated=True)
    seen = _capture_layer_inputs(model)
    ids, labels = make_batch(CFG, 2, 16, seed=0)
    with inject_failures(free=1) as injected, pytest.raises(InjectedFailure):
        model(ids, labels)
    assert injected.fired == ["free"] and _intact(seen)
    swap_pass.reset()
    seen.clear()
    _exact_step(model, ref)


def test_smartswap_a_failed_free_keeps_the_saved_tensors():
    model, ref = _pair()
    model.recompute = False
    ref.recompute = False
    config = SmartSwapConfig(min_swap_bytes=0)
    ids, labels = make_batch(CFG, 2, 16, seed=0)
    with SmartSwap(model, memory_budget=0.25, config=config) as smart:
        for _ in range(3):  # profile, plan, then swap
            model(ids, labels).backward()
            smart.step()
        model.zero_grad()
        with inject_failures(free=1) as injected:
            try:
                model(ids, labels).backward()
            except InjectedFailure:
                pass
        assert injected.calls.get("free", 0) >= 1
        swap_pass.reset()
        model.zero_grad()
        _exact_step(model, ref)
