"""A model split across two devices (HF ``device_map`` style) and backward on a worker thread, as
autograd runs each device's backward on a thread of its own.

On the test accelerator's two devices (marked ``accelerator``): the first half of the layers on
device 0, the second half and the head on device 1, each layer's inputs moved to its device by a
forward pre-hook, as accelerate's ``AlignDevicesHook`` moves them; the groups a layer starts use
its device's streams. Side-stream copies run late there, and an unordered read, write or free the
device counts fails a test at teardown (``tests/conftest.py``).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import swap_pass
from swap_pass.testing import accelerator as device_knobs
from swap_pass.tools.models import LlamaStyleModel
from tests.conftest import NEEDS_TEST_ACCELERATOR
from tests.eager.helpers import CFG, assert_clean, assert_exact, batch, train_step

pytestmark = NEEDS_TEST_ACCELERATOR


def _split(model: LlamaStyleModel, devices: tuple[torch.device, torch.device]) -> None:
    """Put the first half of the layers (and the embedding) on ``devices[0]``, the rest on
    ``devices[1]``; each layer's pre-hook moves its inputs to its device."""
    half = len(model.layers) // 2
    model.to(devices[0])
    for i, layer in enumerate(model.layers):
        dev = devices[1 if i >= half else 0]
        layer.to(dev)
        layer.register_forward_pre_hook(
            lambda _m, args, dev=dev: tuple(a.to(dev) for a in args))
    model.norm.to(devices[1])
    model.lm_head.to(devices[1])


def _on_host(step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, grads = step
    return loss.cpu(), {n: g.cpu() for n, g in grads.items()}


def _backward_on_a_thread(loss: torch.Tensor) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loss.backward()
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_a_model_split_across_two_devices_swaps_on_both_and_is_exact(swaptest, recompute):
    devices = (swaptest, torch.device(device_knobs.DEVICE_TYPE, 1))
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=recompute)
    ref = copy.deepcopy(model)
    _split(model, devices)
    _split(ref, devices)
    ids, labels = batch(seed=0)
    data = (ids.to(devices[0]), labels.to(devices[1]))
    expected = _on_host(train_step(ref, data))
    handle = swap_pass.enable_swap_layer_input(model)
    device_knobs.record_copy_windows(True)
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = model(*data)
            _backward_on_a_thread(loss)
            assert_exact(expected, (loss.detach().cpu(), {n: p.grad.cpu()
                                                         for n, p in model.named_parameters()}))
            assert_clean()
        copied_out = {w.device for w in device_knobs.copy_windows() if w.direction == "d2h"}
    finally:
        device_knobs.record_copy_windows(False)
        handle.remove()
    assert copied_out == {0, 1}  # layer inputs left both devices
    assert torch.equal(data[0].cpu(), batch(seed=0)[0])


def test_backward_on_a_worker_thread_is_exact_and_frees(swaptest):
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=True).to(swaptest)
    ref = copy.deepcopy(model)
    data = batch(seed=1, device=swaptest)
    expected = _on_host(train_step(ref, data))
    handle = swap_pass.enable_swap_layer_input(model)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(*data)
        assert swap_pass.swap_stats().device_bytes_released > 0
        _backward_on_a_thread(loss)
        assert_exact(expected, (loss.detach().cpu(), {n: p.grad.cpu()
                                                     for n, p in model.named_parameters()}))
        assert_clean()
    finally:
        handle.remove()
