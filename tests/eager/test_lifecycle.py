"""Lifecycle: remove() and reset() at any point, copies of an enabled model, shared blocks.

Each test trains next to the same model without swap and compares bitwise.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass.runtime.chain import SwapLayerInputManager
from swap_pass.tools.models import LlamaStyleModel
from tests.eager.helpers import CFG, SwapLlamaLayer, assert_clean, assert_exact, batch, train_step


def _pair():
    torch.manual_seed(0)
    ref = LlamaStyleModel(CFG)
    model = copy.deepcopy(ref)
    return ref, model, swap_pass.enable_swap_layer_input(model)


def _swapped_now(handle) -> int:
    return sum(g.stat == "host" for m in handle.managers for g in m.batch_stack)


@pytest.mark.parametrize("how", ["reset", "remove"])
def test_reset_or_remove_between_forward_and_backward_restores_first(how):
    ref, model, handle = _pair()
    b = batch()
    ids_before = b[0].clone()
    ref_out = train_step(ref, b)
    model.zero_grad(set_to_none=True)
    loss = model(*b)
    assert _swapped_now(handle) == CFG.num_layers - 1  # the inputs really are off the device
    swap_pass.reset() if how == "reset" else handle.remove()
    loss.backward()
    got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert_exact(ref_out, got)
    assert torch.equal(b[0], ids_before)
    assert_clean()
    if how == "reset":
        handle.remove()
    assert not SwapLayerInputManager.manager_map


def test_step_after_reset_swaps_again_with_swap_still_enabled():
    ref, model, handle = _pair()
    b = batch()
    assert_exact(train_step(ref, b), train_step(model, b))
    swap_pass.reset()
    assert swap_pass.swap_stats().swap_outs == 0
    assert_exact(train_step(ref, b), train_step(model, b))
    assert swap_pass.swap_stats().swap_outs == CFG.num_layers - 1
    assert swap_pass.swap_stats().peak_device_bytes_released > 0
    handle.remove()
    assert not SwapLayerInputManager.manager_map


def test_reset_between_steps_with_decorated_layers():
    class Decorated(LlamaStyleModel):
        def __init__(self):
            super().__init__(CFG)
            self.layers = nn.ModuleList(SwapLlamaLayer(CFG) for _ in range(CFG.num_layers))

    torch.manual_seed(0)
    model = Decorated()
    ref = LlamaStyleModel(CFG)
    ref.load_state_dict(model.state_dict())
    b = batch()
    for _ in range(2):
        assert_exact(train_step(ref, b), train_step(model, b))
        swap_pass.reset()
    assert_exact(train_step(ref, b), train_step(model, b))
    assert swap_pass.swap_stats().swap_outs == CFG.num_layers - 1


def test_deepcopy_of_an_enabled_model_swaps_its_own_layers():
    ref, model, handle = _pair()
    b = batch()
    assert_exact(train_step(ref, b), train_step(model, b))
    twin = copy.deepcopy(model)
    ref_twin = copy.deepcopy(ref)
    with torch.no_grad():  # make the copies differ from the originals
        for p, q in zip(twin.parameters(), ref_twin.parameters(), strict=True):
            p.mul_(0.5), q.mul_(0.5)
    model.zero_grad(set_to_none=True)
    before = swap_pass.swap_stats().swap_outs
    assert_exact(train_step(ref_twin, b), train_step(twin, b))
    assert swap_pass.swap_stats().swap_outs - before == CFG.num_layers - 1
    assert all(p.grad is None for p in model.parameters())  # nothing landed on the original
    twin_handle = twin._swap_pass_handle
    assert twin_handle.module_tag != handle.module_tag
    assert all(layer.forward.layer is layer for layer in twin.layers)
    twin_handle.remove()
    assert handle.active and not any(hasattr(layer, "swap_manager") for layer in twin.layers)
    assert_exact(train_step(ref, b), train_step(model, b))  # the original still swaps
    handle.remove()
    assert not SwapLayerInputManager.manager_map


def test_averaged_model_of_an_enabled_model():
    ref, model, handle = _pair()
    b = batch()
    avg = torch.optim.swa_utils.AveragedModel(model)
    ref_avg = torch.optim.swa_utils.AveragedModel(ref)
    with torch.no_grad():
        assert torch.equal(avg(*b), ref_avg(*b))
    assert_exact(train_step(ref_avg.module, b), train_step(avg.module, b))
    handle.remove()
    avg.module._swap_pass_handle.remove()
    assert not SwapLayerInputManager.manager_map


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickled_enabled_model_loads_and_swaps(how):
    ref, model, handle = _pair()
    b = batch()
    assert_exact(train_step(ref, b), train_step(model, b))
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    before = swap_pass.swap_stats().swap_outs
    assert_exact(train_step(ref, b), train_step(loaded, b))
    assert swap_pass.swap_stats().swap_outs - before == CFG.num_layers - 1
    loaded._swap_pass_handle.remove()
    handle.remove()
    assert not SwapLayerInputManager.manager_map


def test_copy_with_inputs_in_flight_is_refused_clearly():
    _, model, handle = _pair()
    loss = model(*batch())
    with pytest.raises(RuntimeError, match=r"swap_pass\.SwapLayerInputManager: cannot copy or "
                                           r"pickle .* still in flight"):
        copy.deepcopy(model)
    loss.backward()
    handle.remove()
    assert_clean()


def test_one_block_listed_several_times_is_refused_and_leaves_nothing():
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG)
    model.layers = nn.ModuleList([model.layers[0]] * 4)  # ALBERT-style sharing
    with pytest.raises(ValueError, match=r"layers\[1\] is the same LlamaDecoderLayer instance as "
                                         r"layers\[0\]"):
        swap_pass.enable_swap_layer_input(model)
    assert not SwapLayerInputManager.manager_map
    assert ("forward" not in model.layers[0].__dict__
            and not hasattr(model.layers[0], "swap_manager"))
