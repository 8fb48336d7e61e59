"""Races a happens-before checker found in the runtime, each fixed, built again on the test
accelerator; and what cannot be freed in place, or must never be captured.

The race tests run on the test accelerator (marked ``accelerator``: its pass, see
``tests/conftest.py``) with side-stream copies held until someone waits for them, so each copy
runs in the order of the waits, the same in every run. Each checks the data bitwise; an unordered
read, write or free the device counts fails it at teardown (``tests/conftest.py``).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.graph import ops
from swap_pass.runtime.host_pool import host_pool, return_pinned_memory
from swap_pass.testing import accelerator as device_knobs
from swap_pass.testing import no_device_sync
from tests.conftest import on_test_accelerator

N = 4096


def _round_trip(x: torch.Tensor) -> SwapTensors:
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()
    return group


def _produced(dev: torch.device, scale: float = 3.0) -> torch.Tensor:
    """A tensor just computed on the compute stream: the host never waited for it."""
    return torch.arange(float(N), device=dev) * scale


def _expected(scale: float = 3.0) -> torch.Tensor:
    return torch.arange(float(N)) * scale


# --- host buffers go back with their last copy's event, on every caller ---------------------


def _release_by(how: str, x: torch.Tensor) -> SwapTensors | None:
    """Swap ``x`` and give its host buffer back ``how``, its last copy still queued."""
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
@on_test_accelerator
def test_a_host_buffer_reused_on_another_device_waits_for_its_last_copy(swaptest_held, how):
    """Device 0 gives a buffer back while its last copy (out, or back) still uses it; device 1's
    swap-out takes it and must wait for that copy. Before the fix the buffer went back without
    the event of its copy, and device 1's copy out was not ordered after it."""
    dev0, dev1 = swaptest_held, torch.device(device_knobs.DEVICE_TYPE, 1)
    x0, x1 = _produced(dev0), torch.full((N,), 5.0, device=dev1)
    kept = _release_by(how, x0)
    group = _round_trip(x1)  # its copy out takes device 0's buffer
    assert host_pool().gauges()["host_allocations"] == 1  # one buffer, reused
    assert torch.equal(x1.cpu(), torch.full((N,), 5.0))
    if how == "wait_h2d":
        assert torch.equal(x0.cpu(), _expected())
    del group, kept


@on_test_accelerator
def test_a_graph_wait_releases_the_host_buffer_with_its_copy_event(swaptest_held):
    """The graph path's backward ``wait`` gives the buffer back while the prefetch still reads it;
    device 1's ``swap_out`` takes it."""
    dev0, dev1 = swaptest_held, torch.device(device_knobs.DEVICE_TYPE, 1)
    x0, x1 = _produced(dev0), torch.full((N,), 7.0, device=dev1)
    host = ops.wait(ops.swap_out(x0), x0)
    out = ops.wait(torch.ops.swap_pass.prefetch(host, dev0, [], []), host)
    del host  # nothing can read the buffer again: back to the pool, the prefetch still queued
    back = ops.wait(ops.swap_out(x1), x1)
    device_knobs.synchronize(1)  # device 1's copy out runs, after what its stream waits for
    assert torch.equal(out.cpu(), _expected())
    assert torch.equal(back, torch.full((N,), 7.0))


# --- copies that may still run when their memory is freed -----------------------------------


@pytest.mark.parametrize("first", ["source", "host_copy"])
@on_test_accelerator
def test_a_swapped_out_tensor_dying_before_its_wait_orders_its_stream_after_the_copy(
        swaptest_held, first):
    """An exception later in the forward drops the source and its host copy before the wait, in
    either order; the source's block then goes to the compute stream's next allocation. Before
    the fix a host copy dying first took the pending copy out of the registry, and the source's
    finalizer then ordered nothing: the block went back while the copy out could still read it
    (an unordered free)."""
    dev = swaptest_held
    x = _produced(dev)
    host = ops.swap_out(x)
    if first == "source":
        del x
        del host
    else:
        del host
        del x
    later = torch.full((N,), 7.0, device=dev)  # takes the source's block
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    assert ops.pending_transfers() == 0 and swap_pass.swap_stats().host_bytes_in_use == 0


@on_test_accelerator
def test_reset_with_a_prefetch_in_flight_orders_compute_after_it(swaptest_held, monkeypatch):
    """``reset()`` drops a prefetch before its wait: the copy back still writes the output's
    block, which the compute stream's next allocation takes. The host cache has nothing to give
    back here, so ``reset()`` waits for no copy on the host (freeing cached pinned blocks would)."""
    dev = swaptest_held
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: None)
    x = _produced(dev)
    host = ops.wait(ops.swap_out(x), x)
    out = torch.ops.swap_pass.prefetch(host, dev, [], [])
    swap_pass.reset()
    del out, host
    later = torch.full((N,), 7.0, device=dev)  # takes the prefetch output's block
    again = ops.wait(ops.swap_out(x), x)
    device_knobs.synchronize(0)  # the dropped prefetch has run by now, wherever it wrote
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    assert torch.equal(again, _expected())


@on_test_accelerator
def test_a_group_dropped_mid_flight_needs_no_host_wait(swaptest_held):
    """A group collected with its copy out in flight (an exception before ``wait_d2h``): its
    buffers go back with the copy's event, without the host waiting for the device
    (``Event.synchronize`` is missing on some torch_npu builds); device 1's copy out takes the
    buffer and must be ordered after that copy."""
    dev0, dev1 = swaptest_held, torch.device(device_knobs.DEVICE_TYPE, 1)
    x, y = _produced(dev0), torch.full((N,), 7.0, device=dev1)
    with no_device_sync(dev0, "dropping a group mid-flight"):
        group = SwapTensors([x])
        group.swap_to_host()
        del group
        gc.collect()
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    again = _round_trip(y)  # its copy out takes the buffer the dropped group gave back
    assert host_pool().gauges()["host_allocations"] == 1  # one buffer, reused
    assert torch.equal(y.cpu(), torch.full((N,), 7.0)) and torch.equal(x.cpu(), _expected())
    del again


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
    buf, _ = pool.take(64, pin=False)
    pool.release(buf, pinned=True)  # as a pinned buffer's bucket
    pool.clear()
    assert calls == [1]
    pool.release(pool.take(64, pin=False)[0], pinned=False)
    pool.clear()  # pageable only: nothing to return
    assert calls == [1]
    pool.release(pool.take(64, pin=False)[0], pinned=True)
    pool.release(pool.take(100, pin=False, max_host_bytes=120)[0])  # over the cap: cache dropped
    assert calls == [1]  # dropped only: no call that can wait for the device inside a step
    pool.release(pool.take(64, pin=False)[0], pinned=True)
    pool.clear()
    assert calls == [1, 1]
    assert pool.gauges()["host_bytes_in_use"] == 0


def test_pinned_memory_is_not_returned_where_the_torch_cannot():
    assert return_pinned_memory() == (
        hasattr(torch.accelerator, "empty_host_cache") and torch.accelerator.is_available())
