"""Several devices and compute streams in one process.

One host pool serves every device, as in a process that drives two accelerators (HF
``device_map``, two models). Each test runs on the test accelerator's two devices (marked
``accelerator``), where side-stream copies run late and an unordered read, write or free the
device counts fails the test at teardown (``tests/conftest.py``); each compares with the same
model without swap bitwise, and checks that the swap really freed storages.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swap_pass
from swap_pass import SmartSwap, SmartSwapConfig, SwapConfig
from swap_pass.testing import accelerator as device_knobs
from swap_pass.tools.models import LlamaStyleModel
from tests.conftest import NEEDS_TEST_ACCELERATOR
from tests.eager.helpers import CFG, assert_clean, assert_exact, batch, train_step
from tests.smart.helpers import Pair, unswapped_peak

pytestmark = NEEDS_TEST_ACCELERATOR


def _devices(swaptest: torch.device) -> tuple[torch.device, torch.device]:
    return swaptest, torch.device(device_knobs.DEVICE_TYPE, 1)


def _pair(device: torch.device, seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaStyleModel(CFG).to(device)
    return model, copy.deepcopy(model)


def _forward(model, data):
    model.zero_grad(set_to_none=True)
    return model(*data)


def _grads(model, loss):
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def _on_host(step):
    loss, grads = step
    return loss.cpu(), {n: g.cpu() for n, g in grads.items()}


def test_two_devices_two_models_interleaved_are_exact(swaptest):
    """Forward on device 0, forward on device 1, backward on 0, backward on 1: host buffers
    released by one device are taken by the other."""
    dev0, dev1 = _devices(swaptest)
    (m0, r0), (m1, r1) = _pair(dev0, 0), _pair(dev1, 1)
    d0, d1 = batch(seed=0, device=dev0), batch(seed=1, device=dev1)
    ref0, ref1 = _on_host(train_step(r0, d0)), _on_host(train_step(r1, d1))
    handles = [swap_pass.enable_swap_layer_input(m) for m in (m0, m1)]
    try:
        for _ in range(2):
            loss0 = _forward(m0, d0)
            loss1 = _forward(m1, d1)
            freed = swap_pass.swap_stats().device_bytes_released
            loss0.backward()
            loss1.backward()
            assert_exact(ref0, _grads(m0, loss0))
            assert_exact(ref1, _grads(m1, loss1))
            assert freed > 0
            assert_clean()
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(d0[0].cpu(), batch(seed=0)[0])  # the user's batch is intact


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_layers_under_a_non_default_compute_stream_are_exact(swaptest, micro_batches):
    """Forward and backward under another current stream (``with torch.cuda.stream(s)``), with
    micro-batches in flight together."""
    m, r = _pair(swaptest)
    data = [batch(seed=i, device=swaptest) for i in range(micro_batches)]
    r.zero_grad(set_to_none=True)
    for loss in reversed([r(*d) for d in data]):  # the same accumulation order as below
        loss.backward()
    ref = {n: p.grad.cpu() for n, p in r.named_parameters()}
    handle = swap_pass.enable_swap_layer_input(m)
    try:
        stream = torch.Stream(device=swaptest)
        stream.wait_stream(torch.accelerator.current_stream(swaptest))
        with stream:
            m.zero_grad(set_to_none=True)
            losses = [m(*d) for d in data]
            freed = swap_pass.swap_stats().device_bytes_released
            for loss in reversed(losses):
                loss.backward()
            grads = {n: p.grad.to("cpu") for n, p in m.named_parameters()}
        for n, g in grads.items():
            assert torch.equal(g, ref[n]), n
        assert freed > 0
        assert_clean()
    finally:
        handle.remove()


def test_smartswap_alternating_between_two_devices_is_exact(swaptest):
    """One SmartSwap, each step on the other device (the model and its twin moved there): the
    buffers one device's groups give back are taken by the other's."""
    devices = _devices(swaptest)
    pair = Pair(devices[0])
    peak0 = unswapped_peak(pair)
    config = SmartSwapConfig(swap=SwapConfig(use_streams=True))
    device_knobs.record_copy_windows(True)
    try:
        with SmartSwap(pair.model, memory_budget=0.25, config=config) as smart:
            peaks = []
            for step in range(4):
                pair.device = devices[step % 2]
                pair.model.to(pair.device)
                pair.ref.to(pair.device)
                peaks.append(pair.step(smart, seed=step).peak)  # loss and gradients bitwise
            assert swap_pass.swap_stats().swap_outs > 0
        copied_out = {w.device for w in device_knobs.copy_windows() if w.direction == "d2h"}
    finally:
        device_knobs.record_copy_windows(False)
    assert peaks[-1] < peak0  # saved storages really left the device
    assert copied_out == {0, 1}


def test_graph_path_with_retain_graph_on_two_devices_is_exact(swaptest):
    """A compiled graph kept with retain_graph on device 0 while device 1 trains: the retained
    graph's host buffers stay its own, the rest go between devices with their copy events."""
    from tests.graph.helpers import batch as graph_batch
    from tests.graph.helpers import tiny_model

    dev0, dev1 = _devices(swaptest)
    torch._dynamo.reset()
    m0, m1 = tiny_model(3, seed=0, device=dev0), tiny_model(3, seed=1, device=dev1)
    r0, r1 = copy.deepcopy(m0), copy.deepcopy(m1)
    d0, d1 = graph_batch(m0), graph_batch(m1, seed=1)

    def run(a, b, backend):
        ca, cb = torch.compile(a, backend=backend), torch.compile(b, backend=backend)
        la = ca(*d0)
        la.backward(retain_graph=True)
        lb = cb(*d1)
        lb.backward()
        la.backward()
        return [p.grad.cpu() for p in a.parameters()], [p.grad.cpu() for p in b.parameters()]

    ref = run(r0, r1, "aot_eager")
    got = run(m0, m1, swap_pass.make_swap_backend("aot_eager"))
    assert swap_pass.swap_stats().swap_outs >= 4
    for want, have in zip(ref, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(want, have, strict=True))
    torch._dynamo.reset()
