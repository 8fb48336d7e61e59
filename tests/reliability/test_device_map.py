"""A model split across two devices (HF ``device_map`` style) and backward on a worker thread, as
autograd runs each device's backward on a thread of its own, under the happens-before checker.

The stream model's fake devices stand for the two accelerators: each layer runs inside the fake
device its half of the model lives on, and the groups it starts use that device's streams.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch

import swap_pass
from swap_pass.models import LlamaStyleModel
from swap_pass.testing import stream_model
from tests.eager.helpers import CFG, assert_clean, assert_exact, batch, train_step

pytestmark = pytest.mark.no_stream_model  # each test runs its own model


def _place_layers(model: LlamaStyleModel, fake_model) -> list:
    """Run the first half of the layers on fake device 0, the second on fake device 1."""
    handles, half = [], len(model.layers) // 2
    for i, layer in enumerate(model.layers):
        stack = contextlib.ExitStack()

        def enter(_m, _args, index=1 if i >= half else 0, stack=stack):
            stack.enter_context(fake_model.device(index))

        def leave(_m, _args, _out, stack=stack):
            stack.close()

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    return handles


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
def test_a_model_split_across_two_devices_swaps_on_both_and_is_exact(recompute):
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=recompute)
    ref = copy.deepcopy(model)
    data = batch(seed=0)
    expected = train_step(ref, data)
    handle = swap_pass.enable_swap_layer_input(model)
    try:
        with stream_model(seed=0) as fake:
            hooks = _place_layers(model, fake)
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                loss = model(*data)
                _backward_on_a_thread(loss)
                assert_exact(expected, (loss.detach(), {n: p.grad.clone()
                                                       for n, p in model.named_parameters()}))
                assert_clean()
            for h in hooks:
                h.remove()
        assert fake._fake(0).d2h.issued > 0 and fake._fake(1).d2h.issued > 0  # both devices
        assert not fake.hazards, fake.hazards
    finally:
        handle.remove()
    assert torch.equal(data[0], batch(seed=0)[0])


def test_backward_on_a_worker_thread_is_exact_and_frees():
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=True)
    ref = copy.deepcopy(model)
    data = batch(seed=1)
    expected = train_step(ref, data)
    handle = swap_pass.enable_swap_layer_input(model)
    try:
        with stream_model(seed=1) as fake:
            model.zero_grad(set_to_none=True)
            loss = model(*data)
            assert swap_pass.swap_stats().device_bytes_released > 0
            _backward_on_a_thread(loss)
            assert_exact(expected, (loss.detach(), {n: p.grad.clone()
                                                   for n, p in model.named_parameters()}))
            assert_clean()
        assert not fake.hazards, fake.hazards
    finally:
        handle.remove()
