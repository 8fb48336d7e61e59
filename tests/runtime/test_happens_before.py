"""The happens-before checker of ``swap_pass.testing`` and the races it found, each fixed.

Every test runs its own stream model with ``early_probability=0`` (copies run only when waited
for) and ``check=False``, and asserts ``model.races`` itself: on the code before each fix the
listed race was reported (see Note: [Happens-before checker] in ``swap_pass/testing.py``).
"""

from __future__ import annotations

import gc
import queue
import threading
import weakref

import numpy as np
import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.graph import ops
from swap_pass.runtime.device import device_streams
from swap_pass.runtime.host_pool import host_pool, return_pinned_memory
from swap_pass.testing import ModelEvent, StreamRaceError, stream_model

pytestmark = pytest.mark.no_stream_model  # each test runs its own model

CPU = torch.device("cpu")


def _round_trip(x: torch.Tensor) -> SwapTensors:
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()
    return group


# --- the checker itself ---------------------------------------------------------------------


def test_a_copy_without_producer_wait_is_a_race_naming_the_copy_and_the_compute_stream():
    with stream_model(early_probability=0.0, check=False) as model:
        ds = device_streams("cpu")
        src, dst = torch.ones(4), torch.empty(4)
        ds.wait(ds.d2h_stream(), ds.record_event(ds.compute_stream()))
        ds.copy(ds.d2h_stream(), dst, src)  # ordered after compute: fine
        ds.wait(ds.compute_stream(), ds.record_event(ds.d2h_stream()))
        ds.copy(ds.d2h_stream(), dst, src)  # compute moved on, no new wait: producer race
        ds.wait(ds.compute_stream(), ds.record_event(ds.d2h_stream()))
    assert len(model.races) == 1, model.races
    assert "copy #2 on the d2h stream" in model.races[0] and "compute stream" in model.races[0]
    assert "producer wait is missing" in model.races[0]


def test_unordered_copies_of_two_streams_into_one_buffer_are_a_race_and_raise_on_exit():
    with pytest.raises(StreamRaceError, match=r"copy #2 on the other stream .* copy #1 on the d2h"):
        with stream_model(early_probability=0.0) as model:
            ds, other = device_streams("cpu"), model.new_stream("other")
            buf, a, b = torch.empty(4), torch.ones(4), torch.zeros(4)
            for stream in (ds.d2h_stream(), other):
                ds.wait(stream, ds.record_event(ds.compute_stream()))
            ds.copy(ds.d2h_stream(), buf, a)
            ds.copy(other, buf, b)  # writes buf, not ordered after the d2h write
            model.synchronize()


def test_a_storage_dying_while_its_copy_may_run_is_a_race_even_when_the_model_ran_it():
    with stream_model(early_probability=1.0, check=False) as model:  # copies complete at once
        ds = device_streams("cpu")
        x, host = torch.ones(8), torch.empty(8)
        ds.wait(ds.d2h_stream(), ds.record_event(ds.compute_stream()))
        ds.copy(ds.d2h_stream(), host, x)
        ds.record_event(ds.d2h_stream())
        del x  # no wait on the copy: the allocator may hand its memory out again
    assert any("died" in r and "read of copy #1 on the d2h stream" in r for r in model.races)


@pytest.mark.parametrize("wait", ["in_the_death", "after_the_death", "never"])
def test_a_source_dying_with_its_copy_queued_is_a_race_unless_its_stream_waits_in_the_death(wait):
    """x dies while its copy out is queued: its block goes back to the pool of its allocating
    stream (compute), whose next work may reuse it. A wait on the copy that a finalizer of x's
    storage issues (as the graph path's swap_out does) comes before any such work: the copy ran
    on a block nothing reused, no hazard. A wait issued after the death returned comes too late,
    and no wait at all is a race too."""
    with stream_model(early_probability=0.0, check=False) as model:
        ds = device_streams("cpu")
        x, host = torch.full((8,), 2.0), torch.empty(8)
        ds.wait(ds.d2h_stream(), ds.record_event(ds.compute_stream()))
        ds.copy(ds.d2h_stream(), host, x)
        done = ds.record_event(ds.d2h_stream())
        if wait == "in_the_death":
            weakref.finalize(x.untyped_storage(), ds.wait, ds.compute_stream(), done)
        del x
        if wait == "after_the_death":
            ds.wait(ds.compute_stream(), done)
    if wait == "in_the_death":
        assert not model.races and not model.hazards, (model.races, model.hazards)
        assert model.copies_on_dead_blocks == 1
    else:
        assert len(model.races) == 1 and "died" in model.races[0], model.races
        assert "read of copy #1 on the d2h stream" in model.races[0]
        assert len(model.hazards) == 1 and model.copies_on_dead_blocks == 0, model.hazards


def test_the_copy_queue_holds_no_tensor_alive():
    with stream_model(early_probability=0.0, check=False) as model:
        ds = device_streams("cpu")
        x = torch.ones(8)
        ds.wait(ds.d2h_stream(), ds.record_event(ds.compute_stream()))
        ds.copy(ds.d2h_stream(), torch.empty(8), x)
        del x
        gc.collect()
        assert model.pending() == 1
    assert model.hazards and "storage was freed" in model.hazards[0]


def test_waits_merge_clocks_across_fake_devices_and_streams():
    with stream_model(early_probability=0.0) as model:
        with model.device(1):
            ds1 = device_streams("cpu")
            assert ds1.compute_stream() is not model.compute and ds1.d2h_stream().name == "d2h:1"
        side = model.new_stream("mine", compute=True)
        with model.use_stream(side):
            assert device_streams("cpu").compute_stream() is side
        assert device_streams("cpu").compute_stream() is model.compute
        event = ModelEvent(side)
        model.compute.wait_event(event)
        assert model.compute.has_seen(side, side.now)
        with pytest.raises(ValueError, match="side stream"):
            with model.use_stream(model.d2h):
                pass


class _Worker:
    """A thread that runs the functions handed to it one at a time, each when the test asks:
    two workers interleave their calls on the model's streams in the order the test chooses."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                done.put((True, fn()))
            except BaseException as err:  # re-raised by run() on the test's thread
                done.put((False, err))

    def run(self, fn):
        done: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put((fn, done))
        ok, value = done.get(timeout=60)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


@pytest.mark.parametrize("copier, expected", [("a", 0), ("b", 1)])
def test_producer_waits_are_per_thread_on_a_shared_compute_stream(copier, expected):
    """Threads a and b share the compute stream (a device's default stream is one for all
    threads). a records an event after its work, then b queues work of its own; a copy that
    waits on a's event is ordered after a's work (no race), but not after b's: from b it misses
    its producer wait."""
    a, b = _Worker(), _Worker()
    try:
        with stream_model(early_probability=0.0, check=False) as model:
            ds = device_streams("cpu")
            src, dst = torch.ones(4), torch.empty(4)
            ready = a.run(lambda: ds.record_event(ds.compute_stream()))
            b.run(lambda: ds.record_event(ds.compute_stream()))  # b's work follows a's event

            def copy_after_ready() -> None:
                ds.wait(ds.d2h_stream(), ready)
                ds.copy(ds.d2h_stream(), dst, src)
                ds.wait(ds.compute_stream(), ds.record_event(ds.d2h_stream()))

            {"a": a, "b": b}[copier].run(copy_after_ready)
    finally:
        a.stop()
        b.stop()
    assert len(model.races) == expected, model.races
    if expected:
        assert "producer wait is missing" in model.races[0] and "this thread" in model.races[0]
    assert torch.equal(dst, src)


# --- host buffers go back with their last copy's event, on every caller ---------------------


def _release_by(how: str, x: torch.Tensor) -> SwapTensors | None:
    """Swap ``x`` on the current fake device and give its host buffer back ``how``."""
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    if how == "wait_h2d":
        group.swap_to_device()
        group.wait_h2d()
        return group
    if how == "discard_in_h2d":
        group.swap_to_device()
    group.discard() if how.startswith("discard") else None
    if how == "del_in_h2d":
        group.swap_to_device()
    if how.startswith("del"):
        del group
        gc.collect()
        return None
    return group


@pytest.mark.parametrize("how", ["wait_h2d", "discard_in_host", "discard_in_h2d", "del_in_h2d"])
def test_a_host_buffer_reused_on_another_device_waits_for_its_last_copy(how):
    """Device 0 gives a buffer back; device 1's swap-out takes it. Before the fix the buffer went
    back without the event of its copy, and device 1's D2H was not ordered after it."""
    x0, x1 = torch.full((64,), 3.0), torch.full((64,), 5.0)
    with stream_model(early_probability=0.0, check=False) as model:
        _release_by(how, x0)
        with model.device(1):
            group = _round_trip(x1)
        assert host_pool().gauges()["host_allocations"] == 1  # one buffer, reused
        del group
    assert not model.races, model.races
    assert torch.equal(x1, torch.full((64,), 5.0))
    if how == "wait_h2d":
        assert torch.equal(x0, torch.full((64,), 3.0))


def test_a_graph_wait_releases_the_host_buffer_with_its_copy_event():
    x0, x1 = torch.full((16,), 2.0), torch.full((16,), 7.0)
    with stream_model(early_probability=0.0, check=False) as model:
        host = ops.wait(ops.swap_out(x0), x0)
        dev = ops.wait(torch.ops.swap_pass.prefetch(host, CPU, [], []), host)
        del host  # nothing can read the buffer again: back to the pool
        with model.device(1):
            back = ops.wait(ops.swap_out(x1), x1)
        assert torch.equal(dev, x0)
        del back
    assert not model.races, model.races


# --- copies that may still run when their memory is freed -----------------------------------


def test_a_prefetched_tensor_dying_before_its_wait_orders_its_stream_after_the_copy():
    x = torch.full((16,), 4.0)
    with stream_model(early_probability=0.0, check=False) as model:
        host = ops.wait(ops.swap_out(x), x)
        out = torch.ops.swap_pass.prefetch(host, CPU, [], [])
        del out  # an exception before the wait, say
        ops.wait(ops.swap_out(x), x)
    assert not model.races, model.races
    assert not model.hazards and model.copies_on_dead_blocks == 1, model.hazards
    assert ops.pending_transfers() == 0


@pytest.mark.parametrize("first", ["source", "host_copy"])
def test_a_swapped_out_tensor_dying_before_its_wait_orders_its_stream_after_the_copy(first):
    """An exception later in the forward drops the source and its host copy before the wait, in
    either order. Before the fix a host copy dying first took the pending copy out of the
    registry, and the source's finalizer then ordered nothing: the source's block went back to
    the compute stream's pool while the copy out could still read it."""
    with stream_model(early_probability=0.0, check=False) as model:
        x = torch.full((16,), 4.0)
        host = ops.swap_out(x)
        if first == "source":
            del x
            del host
        else:
            del host
            del x
    assert not model.races and not model.hazards, (model.races, model.hazards)
    assert model.copies_on_dead_blocks == 1
    assert ops.pending_transfers() == 0 and swap_pass.swap_stats().host_bytes_in_use == 0


def test_reset_with_a_prefetch_in_flight_orders_compute_after_it():
    x = torch.full((16,), 4.0)
    with stream_model(early_probability=0.0, check=False) as model:
        host = ops.wait(ops.swap_out(x), x)
        out = torch.ops.swap_pass.prefetch(host, CPU, [], [])
        swap_pass.reset()
        del out, host
        ops.wait(ops.swap_out(x), x)
    assert not model.races, model.races


def test_an_abandoned_copy_out_is_waited_for_before_its_source_can_die():
    """restore() from "d2h" (a group no guard protects): the copy may still read x."""
    with stream_model(early_probability=0.0, check=False) as model:
        x = torch.randn(32)
        group = SwapTensors([x])
        group.swap_to_host()
        group.restore()
        del x, group
        gc.collect()
    assert not model.races, model.races


def test_a_group_dropped_mid_flight_needs_no_event_synchronize(monkeypatch):
    """A backend without Event.synchronize (some torch_npu builds): the buffers still go back."""
    def no_synchronize(self):
        raise RuntimeError("synchronizeEvent is not supported on this build")

    with stream_model(early_probability=0.0, check=False) as model:
        monkeypatch.setattr(ModelEvent, "synchronize", no_synchronize)
        x = torch.randn(32)
        group = SwapTensors([x])
        group.swap_to_host()
        del group
        gc.collect()
        assert swap_pass.swap_stats().host_bytes_in_use == 0
        monkeypatch.undo()
    assert not model.races, model.races


# --- what cannot be freed in place, and what must never be captured -------------------------


@pytest.mark.parametrize("make", ["from_numpy", "frombuffer"])
def test_a_non_resizable_storage_is_kept_and_counted(make):
    data = np.arange(32, dtype=np.float32)
    if make == "from_numpy":
        x = torch.from_numpy(data)
    else:
        x = torch.frombuffer(bytearray(data.tobytes()), dtype=torch.float32)
    assert not x.untyped_storage().resizable()
    with pytest.warns(RuntimeWarning, match="non_resizable"):
        group = _round_trip(x)
    assert group.is_empty and x.untyped_storage().nbytes() == 128
    assert torch.equal(x, torch.arange(32, dtype=torch.float32))
    stats = swap_pass.swap_stats()
    assert stats.skipped_bytes["non_resizable"] == 128 and stats.swap_outs == 0


def test_a_group_keeps_its_non_resizable_storage_and_swaps_the_rest():
    kept, swapped = torch.from_numpy(np.ones(8, dtype=np.float32)), torch.randn(16)
    with pytest.warns(RuntimeWarning, match=r"stays on the device \(non_resizable\)"):
        group = SwapTensors([kept, swapped])
    group.swap_to_host()
    group.wait_d2h()
    assert swapped.untyped_storage().nbytes() == 0 and kept.untyped_storage().nbytes() == 32
    group.swap_to_device()
    group.wait_h2d()
    assert swap_pass.swap_stats().skipped_bytes["non_resizable"] == 32


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"),
                    reason="this torch has no cudagraph_unsafe tag")
@pytest.mark.parametrize("op", ["swap_out", "prefetch", "swap_in", "wait"])
def test_graph_ops_are_never_captured_into_a_cuda_graph(op):
    assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.swap_pass, op).default.tags


# --- pinned memory goes back ------------------------------------------------------------------


def test_dropping_cached_pinned_buffers_returns_pinned_memory(monkeypatch):
    """Only clearing the pool (``reset()``) returns pinned memory; an eviction over the cap only
    drops buffers, since ``empty_host_cache`` can wait for the device (Note: [Nothing that can
    synchronize] in ``host_pool.py``). The real call needs an accelerator: here it is counted
    (on a GPU, scripts/gpu_check.sh measures pinned bytes after reset())."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append(1),
                        raising=False)
    pool = host_pool()
    buf = pool.acquire(64, pin=False)
    pool.release(buf, pinned=True)  # as a pinned buffer's bucket
    pool.clear()
    assert calls == [1]
    pool.release(pool.acquire(64, pin=False), pinned=False)
    pool.clear()  # pageable only: nothing to return
    assert calls == [1]
    pool.release(pool.acquire(64, pin=False), pinned=True)
    pool.release(pool.acquire(100, pin=False, max_host_bytes=120))  # over the cap: cache dropped
    assert calls == [1]  # dropped only: no call that can wait for the device inside a step
    pool.release(pool.acquire(64, pin=False), pinned=True)
    pool.clear()
    assert calls == [1, 1]
    assert pool.gauges()["host_bytes_in_use"] == 0


def test_pinned_memory_is_not_returned_where_the_torch_cannot():
    assert return_pinned_memory() == (
        hasattr(torch.accelerator, "empty_host_cache") and torch.accelerator.is_available())
