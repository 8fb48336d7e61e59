"""The test accelerator's order check as a happens-before checker, its asynchronous default-stream
copies and its memory cap.

Each hazard is built twice: without the ordering a device needs (the counter moves, or the reader
sees poison) and with it (exact, nothing counted). Most run under a 60 s copy delay, so a copy
runs when someone waits for it, the same in every run.
"""

from __future__ import annotations

import pytest
import torch

from swap_pass.testing import accelerator as device_knobs

from .conftest import needs_test_accelerator

pytestmark = [*needs_test_accelerator, pytest.mark.unordered_on_purpose]

N = 4096


def _moved(before: dict[str, int]) -> dict[str, int]:
    """How far each order counter moved since ``before`` (after every stream ran)."""
    device_knobs.synchronize()
    after = device_knobs.order_counters()
    return {name: after[name] - before[name] for name in before}


def _nothing() -> dict[str, int]:
    return {"unordered_reads": 0, "unordered_writes": 0, "unordered_frees": 0}


def _only(name: str) -> dict[str, int]:
    return {**_nothing(), name: 1}


def _compute(dev: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(dev)


# --- write after read, write after write, the allocation as a write ----------------------------


@pytest.mark.parametrize("waits", [False, True], ids=["no_wait", "wait"])
def test_a_write_over_what_a_queued_copy_out_reads(long_delay, waits: bool) -> None:
    """Write after read: compute overwrites a tensor a side-stream copy out still reads."""
    dev = long_delay
    side = torch.Stream(device=dev)
    x = torch.arange(N, dtype=torch.float32, device=dev)
    host = torch.empty(N, pin_memory=True)
    side.wait_stream(_compute(dev))
    with side:
        host.copy_(x, non_blocking=True)
    before = device_knobs.order_counters()
    if waits:
        _compute(dev).wait_stream(side)
    x.add_(1)
    assert _moved(before) == (_nothing() if waits else _only("unordered_writes"))


@pytest.mark.parametrize("waits", [False, True], ids=["no_wait", "wait"])
def test_a_copy_into_a_block_just_allocated_on_another_stream(long_delay, waits: bool) -> None:
    """The allocation is a write on the allocating stream: a copy in on a side stream that did not
    wait for it may land before the block's previous user is done with it."""
    dev = long_delay
    side = torch.Stream(device=dev)
    src = torch.ones(N, pin_memory=True)
    before = device_knobs.order_counters()
    dst = torch.empty(N, device=dev)
    if waits:
        side.wait_stream(_compute(dev))
    with side:
        dst.copy_(src, non_blocking=True)
    _compute(dev).wait_stream(side)
    assert torch.equal(dst.cpu(), src)
    assert _moved(before) == (_nothing() if waits else _only("unordered_writes"))


@pytest.mark.parametrize("waits", [False, True], ids=["no_wait", "wait"])
def test_a_copy_back_over_what_compute_reads(long_delay, waits: bool) -> None:
    """Write after read: a side-stream copy in overwrites a tensor compute read before it, without
    waiting for compute."""
    dev = long_delay
    side = torch.Stream(device=dev)
    x = torch.zeros(N, device=dev)
    side.wait_stream(_compute(dev))
    before = device_knobs.order_counters()
    total = x.sum()
    if waits:
        side.wait_stream(_compute(dev))
    with side:
        x.copy_(torch.ones(N, pin_memory=True), non_blocking=True)
    _compute(dev).wait_stream(side)
    assert total.item() == 0.0
    assert _moved(before) == (_nothing() if waits else _only("unordered_writes"))


# --- byte ranges --------------------------------------------------------------------------------


def test_two_streams_write_disjoint_halves_and_each_reader_waits(long_delay) -> None:
    """Writes are tracked per byte range: a reader of one half waits only for its writer."""
    dev = long_delay
    a, b = torch.Stream(device=dev), torch.Stream(device=dev)
    x = torch.empty(2 * N, device=dev)
    a.wait_stream(_compute(dev))
    b.wait_stream(_compute(dev))
    before = device_knobs.order_counters()
    with a:
        x[:N].copy_(torch.ones(N, pin_memory=True), non_blocking=True)
    with b:
        x[N:].copy_(torch.full((N,), 2.0, pin_memory=True), non_blocking=True)
    _compute(dev).wait_stream(a)
    first = x[:N].sum()  # reads only a's half
    _compute(dev).wait_stream(b)
    assert first.item() == N and x[N:].sum().item() == 2 * N
    assert _moved(before) == _nothing()


def test_a_read_of_a_half_another_stream_wrote_without_a_wait(long_delay) -> None:
    """A partial write hidden by a later write of the other half: the reader of the whole is
    ordered after the second writer only, and its read gets poison (the whole of it)."""
    dev = long_delay
    side = torch.Stream(device=dev)
    x = torch.zeros(2 * N, device=dev)
    side.wait_stream(_compute(dev))
    with side:
        x[:N].copy_(torch.ones(N, pin_memory=True), non_blocking=True)
    before = device_knobs.order_counters()
    x[N:].fill_(2.0)  # compute writes the other half; the whole is read next
    values = x.cpu()
    assert torch.isnan(values).all()
    assert _moved(before) == _only("unordered_reads")


# --- pinned host memory -------------------------------------------------------------------------


@pytest.mark.parametrize("waits", [False, True], ids=["no_wait", "wait"])
def test_a_copy_back_reads_a_host_buffer_another_stream_fills(long_delay, waits: bool) -> None:
    """A race through pinned memory: stream A copies out into a host buffer, stream B copies it
    back without waiting for A."""
    dev = long_delay
    a, b = torch.Stream(device=dev), torch.Stream(device=dev)
    x = torch.arange(N, dtype=torch.float32, device=dev)
    host = torch.empty(N, pin_memory=True)
    back = torch.empty(N, device=dev)
    a.wait_stream(_compute(dev))
    b.wait_stream(_compute(dev))
    before = device_knobs.order_counters()
    with a:
        host.copy_(x, non_blocking=True)
    if waits:
        b.wait_stream(a)
    with b:
        back.copy_(host, non_blocking=True)
    _compute(dev).wait_stream(b)
    values = back.cpu()
    if waits:
        assert torch.equal(values, torch.arange(N, dtype=torch.float32))
        assert _moved(before) == _nothing()
    else:
        assert torch.isnan(values).all()
        assert _moved(before) == _only("unordered_reads")


def test_a_reused_pinned_block_is_poisoned() -> None:
    """A cached pinned block handed out again holds no data of its last user."""
    first = torch.full((N + 3,), 7.0, pin_memory=True)  # a size no other test pins
    ptr = first.data_ptr()
    del first
    second = torch.empty(N + 3, pin_memory=True)
    assert second.data_ptr() == ptr
    assert torch.isnan(second).all()


# --- host orderings: query, .item(), across devices --------------------------------------------


@pytest.mark.parametrize("poll", ["event", "stream"])
def test_a_query_that_answers_true_orders_the_host(dev, poll: str) -> None:
    """Polling ``query()`` until True, then queueing a reader on another stream without a wait,
    is correct on CUDA: the host saw the copy complete before it queued the reader."""
    device_knobs.set_delay(True, 1.0, 2.0)
    side = torch.Stream(device=dev)
    dst = torch.empty(N, device=dev)
    side.wait_stream(_compute(dev))
    before = device_knobs.order_counters()
    with side:
        dst.copy_(torch.ones(N, pin_memory=True), non_blocking=True)
        done = torch.Event(device=dev)
        done.record(side)
    while not (done.query() if poll == "event" else side.query()):
        pass
    assert dst.sum().item() == N
    assert _moved(before) == _nothing()


def test_item_of_a_value_written_on_another_stream_without_a_wait(long_delay) -> None:
    dev = long_delay
    side = torch.Stream(device=dev)
    x = torch.zeros(1, device=dev)
    side.wait_stream(_compute(dev))
    with side:
        x.add_(1)
    before = device_knobs.order_counters()
    x.item()  # the host waits for the compute stream only
    assert _moved(before) == _only("unordered_reads")


def test_a_copy_across_devices_orders_both_current_streams(long_delay) -> None:
    """CUDA's two-way barrier: a copy from device 1 (a side stream current) to device 0 waits for
    device 0's current stream, which then waits for it; device 0's reader needs no wait."""
    dev0, dev1 = torch.device("swaptest", 0), torch.device("swaptest", 1)
    src = torch.arange(N, dtype=torch.float32, device=dev1)
    dst = torch.zeros(N, device=dev0)
    side = torch.Stream(device=dev1)
    side.wait_stream(_compute(dev1))
    before = device_knobs.order_counters()
    with side:
        dst.copy_(src)
    assert torch.equal(dst.cpu(), torch.arange(N, dtype=torch.float32))
    assert _moved(before) == _nothing()


# --- copies on the default stream ---------------------------------------------------------------


def test_a_non_blocking_copy_to_pinned_memory_on_the_default_stream_is_queued(long_delay) -> None:
    """As on CUDA: the host that reads the buffer before it synchronizes reads what was there."""
    dev = long_delay
    x = torch.arange(N, dtype=torch.float32, device=dev)
    host = torch.empty(N, pin_memory=True)
    host.copy_(x, non_blocking=True)
    assert torch.isnan(host).all()
    torch.accelerator.synchronize(dev)
    assert torch.equal(host, torch.arange(N, dtype=torch.float32))


def test_a_copy_to_pageable_memory_on_the_default_stream_blocks(long_delay) -> None:
    dev = long_delay
    x = torch.arange(N, dtype=torch.float32, device=dev)
    host = torch.empty(N)
    host.copy_(x, non_blocking=True)  # pageable: the host waits, as on CUDA
    assert torch.equal(host, torch.arange(N, dtype=torch.float32))


def test_a_non_blocking_copy_in_on_the_default_stream_is_ordered_before_compute(long_delay) -> None:
    dev = long_delay
    src = torch.arange(N, dtype=torch.float32).pin_memory()
    before = device_knobs.order_counters()
    x = src.to(dev, non_blocking=True)
    assert (x * 2).sum().item() == 2 * src.sum().item()
    assert _moved(before) == _nothing()


# --- the memory cap -----------------------------------------------------------------------------


@pytest.fixture
def capped(dev):
    """Device 0 capped at 64 MiB for one test; the cap is lifted and the cache emptied after."""
    torch.swaptest.set_per_process_memory_fraction(
        (64 << 20) / torch.swaptest.get_device_properties(0).total_memory, 0)
    yield dev
    torch.swaptest.set_per_process_memory_fraction(1.0, 0)
    device_knobs.empty_cache()


def test_the_device_reports_its_memory(dev) -> None:
    total = torch.swaptest.get_device_properties(dev).total_memory
    free, reported = torch.swaptest.mem_get_info(dev)
    assert reported == total == torch.accelerator.get_memory_info(dev)[1]
    assert 0 < free <= total


def test_an_allocation_past_the_cap_raises_out_of_memory(capped) -> None:
    dev = capped
    kept = torch.empty(40 << 20, dtype=torch.uint8, device=dev)
    with pytest.raises(torch.OutOfMemoryError, match="set_per_process_memory_fraction"):
        torch.empty(40 << 20, dtype=torch.uint8, device=dev)
    del kept
    again = torch.empty(40 << 20, dtype=torch.uint8, device=dev)  # fits once it is freed
    assert again.numel() == 40 << 20


def test_the_cap_frees_cached_blocks_before_it_refuses(capped) -> None:
    dev = capped
    torch.empty(40 << 20, dtype=torch.uint8, device=dev)  # freed at once: cached, reserved
    assert device_knobs.memory_stats(0)["reserved_bytes"] >= 40 << 20
    other = torch.empty(50 << 20, dtype=torch.uint8, device=dev)  # no cached block fits it
    assert other.numel() == 50 << 20
    assert device_knobs.memory_stats(0)["reserved_bytes"] <= 64 << 20


def test_the_cap_rejects_a_fraction_out_of_range_and_an_unknown_device(dev) -> None:
    with pytest.raises(RuntimeError, match=r"fraction must be in \[0, 1\]"):
        torch.swaptest.set_per_process_memory_fraction(1.5, 0)
    with pytest.raises(RuntimeError, match=r"no device 5 \(2 devices\)"):
        torch.swaptest.set_per_process_memory_fraction(0.5, 5)
    with pytest.raises(RuntimeError, match=r"no device 5 \(2 devices\)"):
        torch.swaptest.mem_get_info(5)
