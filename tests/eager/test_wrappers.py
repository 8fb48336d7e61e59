"""MindSpeed's decorators on a tiny Llama: exact gradients, real frees, guards before readers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import swap_pass
from swap_pass.eager import _protocol
from swap_pass.runtime.freeing import in_backward
from tests.eager.helpers import (
    CFG,
    CheckpointedModel,
    SwapLlamaLayer,
    assert_clean,
    assert_exact,
    batch,
    train_step,
    twin,
)

MODES = ["none", "non_reentrant", "reentrant", "megatron"]


def _pair(mode: str, cfg=CFG, layer_cls=SwapLlamaLayer):
    torch.manual_seed(0)
    ref = CheckpointedModel(cfg, mode)
    return ref, twin(ref, lambda: CheckpointedModel(cfg, mode, layer_cls))


def _capture_inputs(model) -> list[torch.Tensor]:
    """Each layer's first-forward input (recomputations inside backward are ignored)."""
    seen: list[torch.Tensor] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(
            lambda m, args: None if in_backward() else seen.append(args[0]))
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_gradients_bitwise_equal(mode):
    ref, model = _pair(mode)
    for step in range(2):
        assert_exact(train_step(ref, batch(seed=step)), train_step(model, batch(seed=step)))
        assert_clean()
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == 2 * (CFG.num_layers - 1)


def test_bf16_autocast_bitwise_equal():
    ref, model = _pair("non_reentrant")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = train_step(ref, batch())
        got = train_step(model, batch())
    assert_exact(expected, got)
    assert swap_pass.swap_stats().swap_outs == CFG.num_layers - 1
    assert_clean()


@pytest.mark.parametrize("mode", MODES)
def test_l8_at_most_two_layer_inputs_resident_after_forward(mode):
    cfg = dataclasses.replace(CFG, num_layers=8)
    _, model = _pair(mode, cfg)
    inputs = _capture_inputs(model)
    loss = model(*batch(cfg))
    assert len(inputs) == 8
    resident = [i for i, x in enumerate(inputs) if x.untyped_storage().nbytes() > 0]
    assert len(resident) <= 2 and resident[-1] == 7, resident
    stats = swap_pass.swap_stats()
    one = inputs[7].untyped_storage().nbytes()
    assert stats.swap_outs == 7 and stats.device_bytes_released == 7 * one
    assert stats.host_bytes_in_use == 7 * one
    loss.backward()
    assert all(x.untyped_storage().nbytes() == one for x in inputs)
    assert_clean()


class _RecomputeChecker(SwapLlamaLayer):
    """Raises instead of reading when its recomputation sees a freed input (CPU would crash)."""

    reads: list[int] = []

    def forward(self, hidden_states, cos, sin):
        if in_backward():
            nbytes = hidden_states.untyped_storage().nbytes()
            type(self).reads.append(nbytes)
            if nbytes == 0:
                raise RuntimeError("recompute read a layer input before its H2D finished")
        return super().forward(hidden_states, cos, sin)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "megatron"])
def test_recompute_reads_only_restored_inputs(mode):
    _RecomputeChecker.reads = []
    _, model = _pair(mode, layer_cls=_RecomputeChecker)
    train_step(model, batch())
    assert len(_RecomputeChecker.reads) == CFG.num_layers
    assert all(n > 0 for n in _RecomputeChecker.reads)


def test_recompute_check_catches_a_late_wait(monkeypatch):
    """Negative control: without the guard's wait, the recompute sees a freed input."""
    _RecomputeChecker.reads = []
    monkeypatch.setattr(_protocol.BackwardGuard, "__call__", lambda self, grad: None)
    _, model = _pair("non_reentrant", layer_cls=_RecomputeChecker)
    loss = model(*batch())
    with pytest.raises(RuntimeError, match="before its H2D"):
        loss.backward()


def test_prefetch_starts_previous_layer_before_its_backward():
    _, model = _pair("non_reentrant")
    states: list[list[str]] = []
    def watch(grad):
        states.append([str(grp.stat) for layer in model.layers
                       for grp in layer.swap_manager.batch_stack])

    # A gradient hook on each layer's output, registered after the layer's own guard, runs
    # right after it. (Not a full backward pre-hook: it would wrap each layer input in a view
    # the checkpoint keeps, a second holder, and the ownership rule would keep them on device.)
    def on_forward(module, args, out):
        if not in_backward():
            out.register_hook(watch)

    for layer in model.layers:
        layer.register_forward_hook(on_forward)
    train_step(model, batch())
    # Right after layer 3's guard, layer 2's input is readable (out of the FIFO) and layer 1's
    # H2D has started (prefetch, two layers ahead), and so on down to layer 0.
    assert states == [["host", "h2d"], ["h2d"], [], []]


def test_last_layer_never_swapped_and_first_layer_is():
    _, model = _pair("none")
    inputs = _capture_inputs(model)
    loss = model(*batch())
    assert inputs[-1].untyped_storage().nbytes() > 0
    assert all(x.untyped_storage().nbytes() == 0 for x in inputs[:-1])
    loss.backward()


def test_managers_in_construction_order_and_mtp_gets_none():
    layers = [SwapLlamaLayer(CFG) for _ in range(3)]
    mtp = SwapLlamaLayer(CFG, is_mtp=True)
    managers = swap_pass.SwapLayerInputManager.managers("tests.eager")
    assert [m.layer_idx for m in managers] == [0, 1, 2]
    assert [layer.swap_manager for layer in layers] == managers
    assert not hasattr(mtp, "swap_manager") and len(managers) == 3
