"""The compute stream of a swap is fixed when the swap begins, never looked up later.

The runtime issues each side-stream copy inside ``with stream:``, and a finalizer that the cyclic
collector runs there sees the side stream as the current one; so does code run under a user's
``with stream:``. A wait put on the current stream instead of the swap's compute stream lets a
reader see a copy's destination before it is written (poison), or a freed block go back to its
allocating stream while a copy still reads it. See Note: [The compute stream of a swap].

Run on the test accelerator (marked ``accelerator``) with side-stream copies held until someone
waits for them; an unordered read, write or free the device counts fails a test at teardown.
"""

from __future__ import annotations

import pytest
import torch

from swap_pass import SwapConfig, SwapTensors
from swap_pass.runtime.device import DeviceStreams
from tests.conftest import on_test_accelerator

STREAMS = SwapConfig(use_streams=True)
N = 4096


@pytest.fixture
def during_next_copy(monkeypatch):
    """``during_next_copy(fn)``: run ``fn`` inside the runtime's next side-stream copy, with that
    side stream current, as a finalizer run by the cyclic collector there would."""
    pending = []
    copy = DeviceStreams.copy

    def copy_running_fn(self, stream, dst, src, *args, **kwargs):
        if pending and stream is not None:
            with stream:
                pending.pop()()
        return copy(self, stream, dst, src, *args, **kwargs)

    monkeypatch.setattr(DeviceStreams, "copy", copy_running_fn)
    return pending.append


def _swap_something_else(dev: torch.device) -> SwapTensors:
    """A copy out of another group: the copy inside which the test's callback runs."""
    other = SwapTensors([torch.randn(64, device=dev)], config=STREAMS)
    other.swap_to_host()
    return other


@on_test_accelerator
def test_a_restore_run_inside_a_copy_waits_on_the_swaps_compute_stream(swaptest_held,
                                                                       during_next_copy):
    dev = swaptest_held
    x = torch.arange(float(N), device=dev) * 3
    expected = x.cpu()
    group = SwapTensors([x], config=STREAMS)
    group.swap_to_host()
    group.wait_d2h()
    during_next_copy(group.restore)  # as a finalizer run by the collector there
    other = _swap_something_else(dev)
    assert group.stat == "device"
    assert torch.equal((x * 1).cpu(), expected)  # read on the compute stream, right after
    other.restore()


@on_test_accelerator
def test_waits_go_to_the_stream_current_when_the_swap_began(swaptest_held):
    """A swap begun under a user's ``with stream:``; every later call on the default stream."""
    dev = swaptest_held
    producer = torch.Stream(device=dev)
    producer.wait_stream(torch.accelerator.current_stream(dev))
    with producer:
        x = torch.arange(float(N), device=dev) * 3  # allocated from the producer's pool
        expected = x.to("cpu")
        group = SwapTensors([x], config=STREAMS)
        group.swap_to_host()
    assert group.compute_stream == producer
    group.wait_d2h()  # called on the default stream: the free is ordered on the producer's
    assert x.untyped_storage().nbytes() == 0
    with producer:
        later = torch.full((N,), 7.0, device=dev)  # the producer's next allocation
    group.swap_to_device()  # the storage is allocated on the producer's stream again
    group.wait_h2d()
    with producer:
        assert torch.equal((x * 1).to("cpu"), expected)
        assert torch.equal(later.to("cpu"), torch.full((N,), 7.0))
