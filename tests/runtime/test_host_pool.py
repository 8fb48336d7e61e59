"""Host pool cap, preflight messages, config validation, import-time version check."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch

import swap_pass
from swap_pass import HostMemoryError, SwapConfig, SwapTensors
from swap_pass._version_check import check_torch_version
from swap_pass.runtime import host_pool, preflight
from swap_pass.runtime.host_pool import BOUND_FACTOR, HostBufferPool, block_bytes
from tests.conftest import ACCELERATOR, HAS_ACCELERATOR, NO_ACCELERATOR_REASON


def test_preflight_error_names_both_numbers() -> None:
    with pytest.raises(HostMemoryError) as err:
        preflight(5_000, available=1_234)
    assert "5000 bytes needed" in str(err.value) and "1234 bytes available" in str(err.value)
    preflight(1_000, available=1_234)


def test_preflight_respects_cap() -> None:
    with pytest.raises(HostMemoryError,
                       match="max_host_bytes is too small.*2048 bytes needed.*1024"):
        preflight(2048, max_host_bytes=1024, available=10**9)


def test_cap_raises_with_error_policy() -> None:
    cfg = SwapConfig(max_host_bytes=1000)
    ok = SwapTensors([torch.randn(200)], config=cfg)  # 800 bytes
    ok.swap_to_host()
    t = torch.randn(100)
    with pytest.raises(HostMemoryError, match="400 bytes needed, 200 bytes available"):
        SwapTensors([t], config=cfg).swap_to_host()
    assert t.untyped_storage().nbytes() == 400
    assert swap_pass.swap_stats().host_bytes_in_use == 800


def test_cap_keeps_on_device_with_policy() -> None:
    cfg = SwapConfig(max_host_bytes=100, on_host_exhausted="keep_on_device")
    t = torch.randn(100)
    ref = t.clone()
    group = SwapTensors([t], config=cfg)
    with pytest.warns(RuntimeWarning, match="keep_on_device"):
        group.swap_to_host()
    group.wait_d2h()
    assert group.kept_on_device and t.untyped_storage().nbytes() == 400
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(t, ref) and swap_pass.swap_stats().kept_on_device == 1


def test_cached_buffers_dropped_before_refusing() -> None:
    pool = host_pool()
    buf = pool.take(600, pin=False, max_host_bytes=1000)[0]
    pool.release(buf)
    assert pool.bytes_reserved == 600
    other = pool.take(700, pin=False, max_host_bytes=1000)[0]  # evicts the cached 600
    assert pool.bytes_reserved == 700
    pool.release(other)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_host_bytes": -1}, "max_host_bytes=-1"),
        ({"on_host_exhausted": "spill"}, "on_host_exhausted='spill'"),
        ({"min_swap_bytes": -5}, "min_swap_bytes=-5"),
    ],
)
def test_config_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SwapConfig(**kwargs)


def test_config_is_frozen_and_enum_valued() -> None:
    cfg = SwapConfig(on_host_exhausted="keep_on_device")
    assert cfg.on_host_exhausted == "keep_on_device"
    with pytest.raises(AttributeError):
        cfg.prefetch = False  # type: ignore[misc]


def test_old_torch_refused_at_import() -> None:
    with pytest.raises(ImportError, match=r"torch 2\.6\.0 is installed.*torch>=2\.11"):
        check_torch_version("2.6.0")
    check_torch_version("2.11.0")
    check_torch_version("2.13.0+cpu")


def test_public_names() -> None:
    for name in ["is_valid_for_swap", "SwapTensors", "SwapLayerInputManager", "SwapStateError",
                 "SwapConfig", "swap_stats", "reset"]:
        assert name in swap_pass.__all__ and hasattr(swap_pass, name)
    fields = swap_pass.SwapStats.__dataclass_fields__
    for f in ["swap_outs", "swap_ins", "swapped_out_bytes", "swapped_in_bytes",
              "host_bytes_in_use", "peak_host_bytes_in_use"]:
        assert f in fields


def test_a_buffer_taken_like_a_tensor_has_its_shape_and_keeps_it() -> None:
    pool = host_pool()
    pool.clear()
    like = torch.empty(3, 4, dtype=torch.float16)
    buf, event = pool.take(like.nbytes, pin=False, like=like)
    assert (buf.dtype, buf.shape, buf.is_contiguous(), event) == (
        torch.float16, like.shape, True, None)
    assert pool.bytes_in_use == 24
    pool.release(buf)
    again, _ = pool.take(24, pin=False, like=like)  # the same layer's next step: no view op
    assert again is buf
    pool.release(again)
    flat, _ = pool.take(24, pin=False)  # a request without a shape: the same bytes, flat uint8
    assert (flat.dtype, flat.shape, flat.data_ptr()) == (torch.uint8, (24,), buf.data_ptr())
    assert pool.bytes_in_use == 24 and pool.bytes_reserved == 24
    pool.release(flat)
    assert pool.bytes_in_use == 0


# --- block bytes: what the host allocator sets aside (Note: [Pinned block bytes]) ------------

MIB = 1 << 20
# Layer inputs of a Llama-3-8B-sized model (hidden 4096, bf16, batch 1) at a few sequence
# lengths: requested bytes, and the pinned block the caching host allocator rounds them up to.
LAYER_INPUTS = [(seq, seq * 4096 * 2) for seq in (1000, 2048, 3000, 4096, 6144)]
PINNED_BLOCKS = [8 * MIB, 16 * MIB, 32 * MIB, 32 * MIB, 64 * MIB]


def test_pinned_blocks_round_up_to_a_power_of_two() -> None:
    assert [block_bytes(n, pinned=True) for _, n in LAYER_INPUTS] == PINNED_BLOCKS
    assert [block_bytes(n, pinned=False) for _, n in LAYER_INPUTS] == [
        n for _, n in LAYER_INPUTS]  # pageable memory: malloc, counted as asked
    assert block_bytes(96 * MIB, pinned=True) == 128 * MIB
    assert [block_bytes(n, pinned=True) for n in (0, 1, 2, 3)] == [0, 1, 2, 4]


@pytest.mark.parametrize("setting", ["pinned_max_round_threshold_mb:16",
                                     "pinned_max_cached_size_mb:16"])
def test_pinned_blocks_above_the_allocator_limits_are_not_rounded(monkeypatch, setting) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", f"expandable_segments:False,{setting}")
    assert [block_bytes(n, pinned=True) for _, n in LAYER_INPUTS] == [
        8 * MIB, 16 * MIB, 3000 * 4096 * 2, 32 * MIB, 6144 * 4096 * 2]


# --- the cap evicts as little as it can, outside the lock ------------------------------------


def _cache(pool, *sizes: int) -> None:
    """Leave one cached (released) pageable buffer of each size in ``pool``."""
    bufs = [pool.take(n, pin=False)[0] for n in sizes]
    for buf in bufs:
        pool.release(buf)


def test_the_cap_evicts_only_what_a_request_needs() -> None:
    pool = host_pool()
    pool.clear()
    _cache(pool, 300, 200, 100)
    allocations = swap_pass.swap_stats().host_allocations
    buf = pool.take(500, pin=False, max_host_bytes=1000)[0]  # 100 over: the 100-byte one goes
    assert pool.bytes_reserved == 1000 and pool.bytes_in_use == 500
    kept = [pool.take(n, pin=False, max_host_bytes=1000)[0] for n in (300, 200)]  # still cached
    assert swap_pass.swap_stats().host_allocations == allocations + 1
    for b in [buf, *kept]:
        pool.release(b)


def test_the_cap_evicts_one_buffer_if_one_will_do_else_the_largest_first() -> None:
    pool = host_pool()
    pool.clear()
    _cache(pool, 300, 200, 100)
    buf = pool.take(850, pin=False, max_host_bytes=1200)[0]  # 250 over: the 300 frees it alone
    assert pool.bytes_reserved == 1150
    pool.release(buf)
    pool.clear()
    _cache(pool, 150, 150, 100)
    buf = pool.take(700, pin=False, max_host_bytes=800)[0]  # 300 over: both 150s, not the 100
    assert pool.bytes_reserved == 800
    again = pool.take(100, pin=False, max_host_bytes=800)[0]
    assert pool.bytes_reserved == 800  # the 100-byte buffer had stayed cached
    pool.release(buf)
    pool.release(again)


def test_a_request_the_cap_refuses_evicts_nothing() -> None:
    pool = host_pool()
    pool.clear()
    held = pool.take(600, pin=False)[0]
    _cache(pool, 300)
    with pytest.raises(HostMemoryError, match="500 bytes needed, 400 bytes available"):
        pool.take(500, pin=False, max_host_bytes=1000)[0]
    assert pool.bytes_reserved == 900  # the cached 300 bytes stayed for a request that fits
    pool.release(held)


@pytest.mark.parametrize("how", ["cap", "clear"])
def test_evicted_buffers_die_outside_the_pool_lock(how) -> None:
    """Freeing a pinned block can wait for the device: no thread may wait for it holding the
    pool's lock (see Note: [Nothing that can synchronize] in ``host_pool.py``)."""
    pool = host_pool()
    pool.clear()
    died_locked = []
    buf = pool.take(300, pin=False)[0]
    weakref.finalize(buf, lambda: died_locked.append(pool._lock.locked()))
    pool.release(buf)
    del buf
    if how == "cap":
        pool.release(pool.take(800, pin=False, max_host_bytes=1000)[0])
    else:
        pool.clear()
    assert died_locked == [False]


# --- pinned buffers (an accelerator only) ----------------------------------------------------


@pytest.mark.accelerator
@pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)
def test_pinned_buffers_count_their_block_and_reset_returns_them() -> None:
    pool = host_pool()
    pool.clear()
    pinned_before = _pinned_by_the_allocator()
    nbytes = 3000 * 4096 * 2  # a 3000-token layer input: a 32 MiB pinned block
    buf = pool.take(nbytes, pin=True)[0]
    assert buf.is_pinned() and buf.nbytes == nbytes
    stats = swap_pass.swap_stats()
    assert stats.host_bytes_in_use == stats.host_bytes_reserved == 32 * MIB
    with pytest.raises(HostMemoryError, match=f"{32 * MIB} bytes needed"):
        pool.take(nbytes, pin=True, max_host_bytes=48 * MIB)[0]  # 64 MiB pinned: over the cap
    pool.release(buf)
    del buf
    swap_pass.reset()
    assert swap_pass.swap_stats().host_bytes_reserved == 0
    assert _pinned_by_the_allocator() == pinned_before  # nothing of ours is still pinned


def _pinned_by_the_allocator() -> int | None:
    """Bytes the CUDA caching host allocator holds once idle blocks are returned (None
    elsewhere: no device-generic count)."""
    torch.accelerator.synchronize()
    torch.accelerator.empty_host_cache()
    if ACCELERATOR != "cuda":
        return None
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


# --- changing sizes: one bucket per block, a default bound (Notes in host_pool.py) -----------


def _one_step(pool, nbytes: int, buffers: int = 4) -> list[int]:
    """Take ``buffers`` buffers of ``nbytes`` at once, check their bytes, give them back; return
    their data pointers."""
    bufs = [pool.take(nbytes, pin=False)[0] for _ in range(buffers)]
    for i, buf in enumerate(bufs):
        assert buf.dtype == torch.uint8 and buf.shape == (nbytes,)
        buf.fill_(i)
    ptrs = [buf.data_ptr() for buf in bufs]
    for i, buf in enumerate(bufs):
        assert torch.equal(buf, torch.full((nbytes,), i, dtype=torch.uint8))
        pool.release(buf)
    return ptrs


def test_sizes_of_one_block_share_its_buffers(monkeypatch) -> None:
    """Where the allocator rounds (pinned blocks; rounding forced here on pageable ones), every
    size up to a block reuses the same cached blocks: no fresh buffer for a new length."""
    monkeypatch.setattr(sys.modules["swap_pass.runtime.host_pool"], "block_bytes",
                        lambda nbytes, pinned: 1 << max(nbytes - 1, 0).bit_length())
    pool = HostBufferPool()
    first = _one_step(pool, 1000)
    assert pool.bytes_reserved == 4 * 1024 and pool.gauges()["host_allocations"] == 4
    for nbytes in (600, 700, 513, 1024):
        assert sorted(_one_step(pool, nbytes)) == sorted(first)
    assert pool.gauges()["host_allocations"] == 4 and pool.bytes_reserved == 4 * 1024
    like = torch.empty(10, 20, dtype=torch.float32)  # 800 bytes, in a 1024-byte block
    buf, _ = pool.take(like.nbytes, pin=False, like=like)
    assert (buf.shape, buf.dtype, buf.data_ptr() in first) == (like.shape, like.dtype, True)
    pool.release(buf)
    pool.clear()
    assert pool.bytes_reserved == 0


def test_the_pool_is_bounded_without_a_cap() -> None:
    """Eight sizes, each a step of four buffers: the pool keeps at most twice the most bytes it
    had in use at once, where it used to keep every size it ever saw."""
    pool = HostBufferPool()
    sizes = [1000 + 100 * i for i in range(8)]
    for nbytes in sizes:
        _one_step(pool, nbytes)
        assert pool.bytes_reserved <= pool.bound_bytes == BOUND_FACTOR * 4 * nbytes
    assert pool.bytes_reserved <= 2 * 4 * sizes[-1] < 4 * sum(sizes)
    again = pool.gauges()["host_allocations"]
    _one_step(pool, sizes[-1])  # the last size is still cached
    assert pool.gauges()["host_allocations"] == again
    pool.clear()
    assert (pool.bytes_reserved, pool.bound_bytes) == (0, 0)


def test_swap_stats_reports_the_bound() -> None:
    swap_pass.reset()
    group = SwapTensors([torch.randn(250)])  # 1000 bytes
    group.swap_to_host()
    group.wait_d2h()
    assert swap_pass.swap_stats().host_pool_bound_bytes == BOUND_FACTOR * 1000
    group.swap_to_device()
    group.wait_h2d()
    swap_pass.reset()
    assert swap_pass.swap_stats().host_pool_bound_bytes == 0


def test_the_bound_follows_reused_buffers_after_a_clear() -> None:
    """``clear()`` lowers the high-water mark the bound is made from, not the gauges' peak: two
    cached buffers taken together afterwards raise it although the peak was higher before."""
    pool = HostBufferPool()
    _one_step(pool, 4000)  # peak in use: 16000 bytes
    pool.clear()
    for nbytes in (1000, 2000):  # each alone: cached, the mark at 2000
        pool.release(pool.take(nbytes, pin=False)[0])
    both = [pool.take(nbytes, pin=False)[0] for nbytes in (1000, 2000)]  # reused together
    assert pool.gauges()["host_allocations"] == 6  # four, then two: none fresh just now
    assert pool.bound_bytes == BOUND_FACTOR * 3000
    for buf in both:
        pool.release(buf)
    pool.clear()
