"""Several fake devices and compute streams in one process, under the happens-before checker.

One host pool serves every device, as in a process that drives two accelerators (HF
``device_map``, two models). Each test runs its own ``stream_model`` (the checker raises on
leaving it when any two accesses are unordered), compares with the same model without swap
bitwise, and checks that the swap really freed storages.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import swap_pass
from swap_pass import SmartSwap, SmartSwapConfig, SwapConfig
from swap_pass.models import LlamaStyleModel
from swap_pass.testing import ModelEvent, stream_model
from tests.eager.helpers import CFG, assert_clean, assert_exact, batch, train_step
from tests.smart.helpers import Pair, unswapped_peak

pytestmark = pytest.mark.no_stream_model  # each test runs its own model


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaStyleModel(CFG)
    return model, copy.deepcopy(model)


def _forward(model, data):
    model.zero_grad(set_to_none=True)
    return model(*data)


def _grads(model, loss):
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_two_devices_two_models_interleaved_are_exact():
    """Forward on device 0, forward on device 1, backward on 0, backward on 1: host buffers
    released by one device are taken by the other."""
    (m0, r0), (m1, r1) = _pair(0), _pair(1)
    d0, d1 = batch(seed=0), batch(seed=1)
    ref0, ref1 = train_step(r0, d0), train_step(r1, d1)
    handles = [swap_pass.enable_swap_layer_input(m) for m in (m0, m1)]
    try:
        with stream_model(seed=0) as model:
            for _ in range(2):
                with model.device(0):
                    loss0 = _forward(m0, d0)
                with model.device(1):
                    loss1 = _forward(m1, d1)
                freed = swap_pass.swap_stats().device_bytes_released
                with model.device(0):
                    loss0.backward()
                with model.device(1):
                    loss1.backward()
                got0, got1 = _grads(m0, loss0), _grads(m1, loss1)
                assert_exact(ref0, got0)
                assert_exact(ref1, got1)
                assert freed > 0
                assert_clean()
        assert not model.hazards, model.hazards
        assert model.copies_queued > 0
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(d0[0], batch(seed=0)[0])  # the user's batch is intact


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_layers_under_a_non_default_compute_stream_are_exact(micro_batches):
    """Forward and backward under another current stream (``with torch.cuda.stream(s)``), with
    micro-batches in flight together."""
    m, r = _pair()
    data = [batch(seed=i) for i in range(micro_batches)]
    r.zero_grad(set_to_none=True)
    for loss in reversed([r(*d) for d in data]):  # the same accumulation order as below
        loss.backward()
    ref = {n: p.grad.clone() for n, p in r.named_parameters()}
    handle = swap_pass.enable_swap_layer_input(m)
    try:
        with stream_model(seed=1) as model:
            stream = model.new_stream("user", compute=True)
            stream.wait_event(ModelEvent(model.compute))  # as s.wait_stream(current) would
            with model.use_stream(stream):
                m.zero_grad(set_to_none=True)
                losses = [m(*d) for d in data]
                freed = swap_pass.swap_stats().device_bytes_released
                for loss in reversed(losses):
                    loss.backward()
        for n, p in m.named_parameters():
            assert torch.equal(p.grad, ref[n]), n
        assert freed > 0 and not model.hazards
        assert_clean()
    finally:
        handle.remove()


def test_smartswap_alternating_between_two_devices_is_exact():
    """One SmartSwap, each step on the other device: the buffers one device's groups give back
    are taken by the other's."""
    pair = Pair()
    peak0 = unswapped_peak(pair)
    config = SmartSwapConfig(swap=SwapConfig(use_streams=True))
    with stream_model(seed=2) as model:
        with SmartSwap(pair.model, memory_budget=0.25, config=config) as smart:
            peaks = []
            for step in range(4):
                with model.device(step % 2):  # pair.step asserts loss and gradients bitwise
                    peaks.append(pair.step(smart, seed=step).peak)
            assert swap_pass.swap_stats().swap_outs > 0
    assert peaks[-1] < peak0  # saved storages really left the device
    assert not model.hazards, model.hazards
    assert {s.name for s in model._all_streams if s.done} >= {"d2h", "d2h:1"}


@pytest.mark.slow
def test_graph_path_with_retain_graph_on_two_devices_is_exact():
    """A compiled graph kept with retain_graph on device 0 while device 1 trains: the retained
    graph's host buffers stay its own, the rest go between devices with their copy events."""
    from tests.graph.helpers import batch as graph_batch
    from tests.graph.helpers import tiny_model

    torch._dynamo.reset()
    m0, m1 = tiny_model(3, seed=0), tiny_model(3, seed=1)
    r0, r1 = copy.deepcopy(m0), copy.deepcopy(m1)
    d0, d1 = graph_batch(m0), graph_batch(m1, seed=1)

    def run(a, b, backend, on=lambda index: contextlib.nullcontext()):
        ca, cb = torch.compile(a, backend=backend), torch.compile(b, backend=backend)
        with on(0):
            la = ca(*d0)
            la.backward(retain_graph=True)
        with on(1):
            lb = cb(*d1)
            lb.backward()
        with on(0):
            la.backward()
        return [p.grad.clone() for p in a.parameters()], [p.grad.clone() for p in b.parameters()]

    ref = run(r0, r1, "aot_eager")
    with stream_model(seed=0) as model:
        got = run(m0, m1, swap_pass.make_swap_backend("aot_eager"), model.device)
        assert swap_pass.swap_stats().swap_outs >= 4
    for want, have in zip(ref, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(want, have, strict=True))
    assert not model.hazards
    torch._dynamo.reset()

