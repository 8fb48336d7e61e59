"""The eager path on each device present (CPU here; CUDA/NPU/XPU where one exists), with and
without side streams. On CUDA the layer sleeps on the compute stream to widen the window in
which a missing event wait would let a copy race the compute (as torchtune's tests do)."""

from __future__ import annotations

import copy

import torch

import swap_pass
from swap_pass.runtime.freeing import in_backward
from swap_pass.tools.models import LlamaStyleModel, make_batch
from tests.eager.helpers import CFG, assert_clean, assert_exact


def _widen_windows(model, device: torch.device) -> None:
    if device.type != "cuda":
        return
    for layer in model.layers:  # a test of CUDA itself: torch.cuda is allowed here
        layer.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(2_000_000))


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_enable_on_device_bitwise_equal(device, use_streams):
    torch.manual_seed(0)
    ref = LlamaStyleModel(CFG, recompute=True).to(device)
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(
        model, config=swap_pass.SwapConfig(use_streams=use_streams))
    _widen_windows(model, device)
    batch = make_batch(CFG, 2, 16, device=device)
    seen: list[torch.Tensor] = []
    for layer in handle.layers:
        layer.register_forward_pre_hook(lambda m, a: None if in_backward() else seen.append(a[0]))
    expected = _step(ref, batch)
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    if device.type != "cpu":
        torch.accelerator.synchronize()
    assert ([x.untyped_storage().nbytes() == 0 for x in seen]
            == [True] * (CFG.num_layers - 1) + [False])
    loss.backward()
    got = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    assert_exact(expected, got)
    assert_clean()
    handle.remove()


def test_prefetch_off_is_exact_and_waits_in_place(device):
    torch.manual_seed(0)
    ref = LlamaStyleModel(CFG).to(device)
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, config=swap_pass.SwapConfig(prefetch=False))
    states: list[list[str]] = []
    for layer in handle.layers:
        layer.register_full_backward_pre_hook(lambda m, g: states.append(
            [str(grp.stat) for mgr in handle.managers for grp in mgr.batch_stack]))
    batch = make_batch(CFG, 2, 8, device=device)
    assert_exact(_step(ref, batch), _step(model, batch))
    assert all(s == "host" for row in states for s in row)  # nothing started early
    assert_clean()
