"""The test accelerator itself: registration, streams and events, queued copies, the caching
allocator, the resize hook, pinned memory and autograd on it."""

from __future__ import annotations

import pytest
import torch

from swap_pass.testing import accelerator as device_knobs
from swap_pass.testing import load_test_accelerator

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

POISON = 0xFF


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, read on the host after the current stream ran its queue."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def _pinned_ones(n: int) -> torch.Tensor:
    return torch.ones(n, pin_memory=True)


# --- registration -------------------------------------------------------------------------------


def test_load_is_idempotent_and_torch_accelerator_reports_it(dev) -> None:
    assert load_test_accelerator() == load_test_accelerator() == "swaptest"
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "swaptest"
    assert torch.accelerator.device_count() == 2
    x = torch.ones(3).to(dev)
    assert x.is_swaptest and x.device == dev


# --- streams and events -------------------------------------------------------------------------


def test_with_stream_makes_it_current_and_restores_the_default(dev) -> None:
    default = torch.accelerator.current_stream(dev)
    side = torch.Stream(device=dev)
    assert side != default and side.device == dev
    with side:
        assert torch.accelerator.current_stream(dev) == side
    assert torch.accelerator.current_stream(dev) == default


def test_the_device_module_has_torch_cuda_stream_api(dev) -> None:
    """``torch.swaptest.Stream()``, ``.Event()`` and ``.stream(s)``, as code written against a
    device module (TRL's activation offloading) calls them."""
    module = torch.get_device_module("swaptest")
    default = module.current_stream()
    side = module.Stream()
    assert side.device == dev and side != default
    with module.stream(side):
        assert module.current_stream() == side
        event = module.Event()
        event.record(side)
    assert module.current_stream() == default
    default.wait_event(event)
    with module.stream(None):
        assert module.current_stream() == default


def test_work_on_one_stream_runs_in_order(long_delay) -> None:
    """H2D then D2H on the same side stream: the second reads what the first wrote."""
    dev = long_delay
    side = torch.Stream(device=dev)
    src = torch.arange(4096, dtype=torch.float32).pin_memory()
    on_dev = torch.empty(4096, device=dev)
    back = torch.empty(4096, pin_memory=True)
    side.wait_stream(torch.accelerator.current_stream(dev))
    with side:
        on_dev.copy_(src, non_blocking=True)
        back.copy_(on_dev, non_blocking=True)
    side.synchronize()
    assert torch.equal(back, src)


def test_event_query_synchronize_and_elapsed_time(long_delay) -> None:
    dev = long_delay
    side = torch.Stream(device=dev)
    start = torch.Event(device=dev, enable_timing=True)
    end = torch.Event(device=dev, enable_timing=True)
    dst = torch.empty(1024, device=dev)
    side.wait_stream(torch.accelerator.current_stream(dev))
    start.record(side)
    with side:
        dst.copy_(_pinned_ones(1024), non_blocking=True)
    end.record(side)
    assert not end.query() and not side.query()
    end.synchronize()
    assert end.query() and side.query()
    assert start.elapsed_time(end) >= 0.0
    assert torch.equal(dst.cpu(), torch.ones(1024))


def test_stream_wait_event_orders_the_compute_stream(long_delay) -> None:
    dev = long_delay
    side = torch.Stream(device=dev)
    dst = torch.empty(256, device=dev)
    side.wait_stream(torch.accelerator.current_stream(dev))
    with side:
        dst.copy_(_pinned_ones(256), non_blocking=True)
    done = side.record_event()
    torch.accelerator.current_stream(dev).wait_event(done)
    assert torch.equal((dst * 2).cpu(), torch.full((256,), 2.0))


def test_two_devices_have_their_own_streams_and_copies_between_them(dev) -> None:
    other = torch.device("swaptest", 1)
    x = torch.arange(10.0, device=dev)
    y = x.to(other)
    assert y.device == other and torch.equal(y.cpu(), torch.arange(10.0))
    s0, s1 = torch.Stream(device=dev), torch.Stream(device=other)
    assert s0.device == dev and s1.device == other
    with torch.accelerator.device_index(1):
        assert torch.accelerator.current_device_index() == 1
        assert torch.accelerator.current_stream().device == other


# --- a missing wait shows ------------------------------------------------------------------------


@pytest.mark.unordered_on_purpose
def test_a_read_before_the_wait_sees_poison_and_after_it_the_data(dev) -> None:
    """Default settings: the H2D copy of a side stream has not run when the compute stream
    reads its destination without waiting; after the wait it has."""
    side = torch.Stream(device=dev)
    dst = torch.empty(4096, device=dev)
    side.wait_stream(torch.accelerator.current_stream(dev))
    with side:
        dst.copy_(_pinned_ones(4096), non_blocking=True)
    done = side.record_event()
    early = dst.cpu()
    assert torch.isnan(early).all()
    torch.accelerator.current_stream(dev).wait_event(done)
    assert torch.equal(dst.cpu(), torch.ones(4096))


def test_delay_off_makes_the_copy_run_without_a_wait(dev) -> None:
    device_knobs.set_delay(False, 0.0, 0.0)
    assert device_knobs.delay_settings()["enabled"] == 0.0
    side = torch.Stream(device=dev)
    dst = torch.empty(64, device=dev)
    side.wait_stream(torch.accelerator.current_stream(dev))  # after dst's allocation
    with side:
        dst.copy_(_pinned_ones(64), non_blocking=True)
    side.synchronize()
    assert torch.equal(dst.cpu(), torch.ones(64))


# --- the caching allocator ----------------------------------------------------------------------


def test_a_freed_block_is_poisoned_and_reused_by_the_next_allocation_on_its_stream(dev) -> None:
    x = torch.ones(1000, device=dev)
    ptr = x.data_ptr()
    del x
    y = torch.empty(1000, device=dev)
    assert y.data_ptr() == ptr
    assert (_bytes(y) == POISON).all()


def test_a_fresh_block_is_poisoned(dev) -> None:
    fresh_before = device_knobs.memory_stats(0).get("fresh_blocks", 0)
    x = torch.empty(3 * 1024 * 1024 + 7, dtype=torch.uint8, device=dev)  # a size no test used
    assert device_knobs.memory_stats(0)["fresh_blocks"] == fresh_before + 1
    assert (_bytes(x) == POISON).all()


def test_a_freed_block_is_not_handed_to_another_stream(dev) -> None:
    x = torch.ones(2000, device=dev)
    ptr = x.data_ptr()
    del x
    with torch.Stream(device=dev):
        y = torch.empty(2000, device=dev)
    assert y.data_ptr() != ptr


def test_record_stream_holds_the_block_until_that_stream_ran(long_delay) -> None:
    dev = long_delay
    side = torch.Stream(device=dev)
    x = torch.ones(3000, device=dev)
    ptr = x.data_ptr()
    side.wait_stream(torch.accelerator.current_stream(dev))
    with side:
        torch.empty(3000, pin_memory=True).copy_(x, non_blocking=True)  # queued, held
    x.record_stream(side)
    del x
    held = torch.empty(3000, device=dev)
    assert held.data_ptr() != ptr
    side.synchronize()
    again = torch.empty(3000, device=dev)
    assert again.data_ptr() == ptr


def test_torch_accelerator_memory_statistics_count_device_blocks(dev) -> None:
    before = torch.accelerator.memory_allocated(dev)
    x = torch.empty(1024 * 1024, dtype=torch.uint8, device=dev)
    assert torch.accelerator.memory_allocated(dev) == before + x.nbytes
    del x
    assert torch.accelerator.memory_allocated(dev) == before


# --- the resize hook ----------------------------------------------------------------------------


def test_storage_resize_frees_and_reallocates_through_the_hook(dev) -> None:
    x = torch.arange(256.0, device=dev)
    storage = x.untyped_storage()
    calls = device_knobs.resize_calls()
    storage.resize_(0)
    assert storage.nbytes() == 0
    storage.resize_(256 * 4)
    assert device_knobs.resize_calls() == calls + 2
    assert torch.isnan(x.cpu()).all()  # a reallocated block holds poison until written
    x.copy_(torch.arange(256.0))
    assert torch.equal(x.cpu(), torch.arange(256.0))


def test_fail_nth_resize_raises_on_that_call_only(dev) -> None:
    a, b = torch.ones(64, device=dev), torch.ones(64, device=dev)
    device_knobs.fail_nth_resize(2)
    a.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="injected failure"):
        b.untyped_storage().resize_(0)
    assert b.untyped_storage().nbytes() == 64 * 4 and torch.equal(b.cpu(), torch.ones(64))
    b.untyped_storage().resize_(0)  # disarmed after it fired
    assert b.untyped_storage().nbytes() == 0


def test_a_storage_marked_not_resizable_keeps_its_data(dev) -> None:
    x = torch.full((32,), 5.0, device=dev)
    device_knobs.mark_not_resizable(x)
    with pytest.raises(RuntimeError, match="not resizable"):
        x.untyped_storage().resize_(0)
    assert torch.equal(x.cpu(), torch.full((32,), 5.0))


# --- pinned host memory -------------------------------------------------------------------------


def test_pinned_blocks_are_rounded_up_to_a_power_of_two(dev) -> None:
    before = device_knobs.pinned_stats()
    h = torch.empty(1000, dtype=torch.uint8, pin_memory=True)
    assert h.is_pinned() and not torch.empty(1000, dtype=torch.uint8).is_pinned()
    during = device_knobs.pinned_stats()
    assert during["pinned_bytes_in_use"] - before["pinned_bytes_in_use"] == 1024
    assert during["requested_bytes_in_use"] - before["requested_bytes_in_use"] == 1000
    del h
    assert device_knobs.pinned_stats()["pinned_bytes_in_use"] == before["pinned_bytes_in_use"]


def test_tensor_pin_memory_and_a_non_blocking_device_to_host_copy(long_delay) -> None:
    dev = long_delay
    x = torch.arange(512.0, device=dev)
    host = torch.full((512,), -1.0).pin_memory()
    assert host.is_pinned()
    side = torch.Stream(device=dev)
    side.wait_stream(torch.accelerator.current_stream(dev))
    with side:
        host.copy_(x, non_blocking=True)
    assert torch.equal(host, torch.full((512,), -1.0))  # the copy has not run yet
    side.synchronize()
    assert torch.equal(host, torch.arange(512.0))


# --- autograd -----------------------------------------------------------------------------------


def test_backward_on_the_device_matches_cpu_bitwise(dev) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    batch = torch.randn(8, 16)
    model(batch).square().mean().backward()
    cpu_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.to(dev)
    model(batch.to(dev)).square().mean().backward()
    for p, ref in zip(model.parameters(), cpu_grads, strict=True):
        assert p.grad.device == dev
        assert torch.equal(p.grad.cpu(), ref)
