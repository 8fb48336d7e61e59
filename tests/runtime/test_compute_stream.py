"""The compute stream of a swap is fixed when the swap begins, never looked up later.

Under the stream model the side stream is current while the runtime issues a copy, as under a
device's ``with stream:``, and a finalizer that the cyclic collector runs there sees it as the
current stream. A wait put on it instead of the swap's compute stream lets a reader see a copy's
destination before it is written (poison), or a freed block go back to its allocating stream
while a copy still reads it (a race). See Note: [The compute stream of a swap].
"""

from __future__ import annotations

import gc

import pytest
import torch

from swap_pass import SwapConfig, SwapTensors, swap_stats
from swap_pass.testing import stream_model

pytestmark = pytest.mark.no_stream_model  # each test runs its own model

STREAMS = SwapConfig(use_streams=True)


def _swap_something_else() -> SwapTensors:
    """A copy out of another group: the copy inside which the test's finalizer runs."""
    other = SwapTensors([torch.randn(64)], config=STREAMS)
    other.swap_to_host()
    return other


def test_a_restore_run_inside_a_copy_waits_on_the_swaps_compute_stream():
    with stream_model(early_probability=0.0) as model:
        x = torch.randn(256)
        expected = x.clone()
        group = SwapTensors([x], config=STREAMS)
        group.swap_to_host()
        group.wait_d2h()
        model.during_next_copy(group.restore)  # as a finalizer run by the collector there
        other = _swap_something_else()
        assert group.stat == "device"
        assert torch.equal(x, expected)  # read on the compute stream, right after
        other.restore()
    assert not model.hazards


def test_a_group_collected_inside_a_copy_orders_its_storages_allocating_stream():
    with stream_model(early_probability=0.0) as model:
        x = torch.randn(256)
        group = SwapTensors([x], config=STREAMS)
        group.swap_to_host()  # the copy out still reads x
        group.cycle = group  # only a reference cycle holds the group now
        del group
        model.during_next_copy(gc.collect)
        other = _swap_something_else()
        del x  # its block goes back to the compute stream's pool: after the copy, or a race
        other.restore()
    assert not model.hazards  # a race would have raised on leaving the model


def test_waits_go_to_the_stream_current_when_the_swap_began():
    with stream_model(early_probability=0.0) as model:
        producer = model.new_stream("producer", compute=True)
        with model.use_stream(producer):
            x = torch.randn(256)
            expected = x.clone()
            group = SwapTensors([x], config=STREAMS)
            group.swap_to_host()
        assert group.compute_stream is producer
        group.wait_d2h()  # called on the default stream: the free is ordered on the producer's
        assert x.untyped_storage().nbytes() == 0
        group.swap_to_device()  # the storage is allocated on the producer's stream again
        group.wait_h2d()
        with model.use_stream(producer):
            assert torch.equal(x, expected)
        del x, group  # its block goes back to the producer's pool: ordered after the copy back
    assert not model.hazards


def test_a_compute_stream_given_to_the_group_is_used():
    with stream_model(early_probability=0.0) as model:
        producer = model.new_stream("producer", compute=True)
        x = torch.randn(256)  # as if made on the producer's stream (MoE dispatch, say)
        model.allocated(x.untyped_storage(), producer)
        expected = x.clone()
        group = SwapTensors([x], config=STREAMS, compute_stream=producer)
        group.swap_to_host()
        group.wait_d2h()
        group.restore()
        assert group.compute_stream is producer and torch.equal(x, expected)
    assert not model.hazards


def test_nothing_is_swapped_while_the_compute_stream_captures_a_graph():
    with stream_model(early_probability=0.0) as model:
        x = torch.randn(256)
        expected = x.clone()
        model.compute.capturing = True
        group = SwapTensors([x], config=STREAMS, name="layers[1]")
        with pytest.warns(RuntimeWarning, match="capturing a graph|CUDA graph"):
            group.swap_to_host()
        group.wait_d2h()
        assert group.kept_on_device and x.untyped_storage().nbytes() == x.nbytes
        assert model.copies_queued == 0 and torch.equal(x, expected)
        group.restore()
        assert swap_stats().skipped_bytes["stream_capture"] == x.nbytes
