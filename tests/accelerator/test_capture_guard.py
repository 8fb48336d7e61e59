"""The capture guard on a device whose stream cannot say it captures: the test accelerator's
device guard, like torch_npu's NPUGuardImpl, leaves ``isStreamCapturing`` at its default (False),
so only the device module's ``is_current_stream_capturing`` knows (see Notes [Asking both
capture queries] in ``swap_pass/runtime/device.py`` and [A group that meets a capture] in
``swap_pass/runtime/group.py``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.testing import accelerator as device_knobs

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

N = 4096


@pytest.fixture
def capture(dev, monkeypatch):
    """``with capture():`` makes the device module say the current stream captures a graph."""
    module = getattr(torch, device_knobs.DEVICE_TYPE)
    state = {"on": False}
    monkeypatch.setattr(module, "is_current_stream_capturing", lambda: state["on"],
                        raising=False)

    @contextlib.contextmanager
    def capturing():
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False

    return capturing


def _tensor(dev) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(float(N), device=dev) * 3
    return x, x.cpu()


def test_the_stream_says_false_so_the_device_module_is_asked(dev, capture) -> None:
    assert not torch.Stream(device=dev).is_capturing()  # the guard's default, as on torch_npu
    x, expected = _tensor(dev)
    group = SwapTensors([x])
    with capture(), pytest.warns(RuntimeWarning, match=r"stays on the device \(stream_capture\)"):
        group.swap_to_host()
    assert group.kept_on_device and swap_pass.swap_stats().swap_outs == 0
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(x.cpu(), expected)
    assert swap_pass.swap_stats().skipped_bytes["stream_capture"] == x.nbytes


def test_a_copy_out_begun_before_a_capture_is_not_freed_inside_it(dev, capture) -> None:
    x, expected = _tensor(dev)
    group = SwapTensors([x])
    group.swap_to_host()
    resizes = device_knobs.resize_calls()
    with capture(), pytest.warns(RuntimeWarning, match=r"stays on the device \(stream_capture\)"):
        group.wait_d2h()  # keeps the data: no free, no wait inside the capture
    assert device_knobs.resize_calls() == resizes
    assert group.kept_on_device and x.untyped_storage().nbytes() == x.nbytes
    assert swap_pass.swap_stats().host_bytes_in_use == 0  # the buffer went back
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(x.cpu(), expected)
    assert swap_pass.swap_stats().skipped_bytes["stream_capture"] == x.nbytes


def test_a_restore_inside_a_capture_is_refused_and_works_after_it(dev, capture) -> None:
    x, expected = _tensor(dev)
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    assert x.untyped_storage().nbytes() == 0
    resizes = device_knobs.resize_calls()
    with capture(), pytest.raises(RuntimeError, match="swap_to_device: called while a stream "
                                                      "captures a graph"):
        group.swap_to_device()
    assert device_knobs.resize_calls() == resizes  # nothing re-allocated
    assert group.stat == "host" and x.untyped_storage().nbytes() == 0
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(x.cpu(), expected)


def test_a_wait_for_a_copy_back_inside_a_capture_is_refused_and_works_after_it(dev,
                                                                                capture) -> None:
    x, expected = _tensor(dev)
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    with capture(), pytest.raises(RuntimeError, match="wait_h2d: called while a stream "
                                                      "captures a graph"):
        group.wait_h2d()
    assert group.stat == "h2d"  # its tensors still guarded: a reader would wait first
    group.wait_h2d()
    assert torch.equal(x.cpu(), expected)
