"""Host pool cap, preflight messages, config validation, import-time version check."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import HostMemoryError, SwapConfig, SwapTensors
from swap_pass._version_check import check_torch_version
from swap_pass.runtime import host_pool, preflight


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
    buf = pool.acquire(600, pin=False, max_host_bytes=1000)
    pool.release(buf)
    assert pool.bytes_reserved == 600
    other = pool.acquire(700, pin=False, max_host_bytes=1000)  # evicts the cached 600
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
