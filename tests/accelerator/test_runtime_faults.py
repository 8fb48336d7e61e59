"""The runtime against faults only a device shows: a free that fails part-way through a group, a
storage the device cannot resize, pinned blocks larger than asked for, a tensor allocated on
another stream than the one that swaps it."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.testing import accelerator as device_knobs

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

N = 4096


def test_a_free_failing_on_the_second_storage_loses_no_data(dev) -> None:
    a, b = torch.arange(float(N), device=dev), torch.arange(float(N), device=dev) + 1
    expected = [a.cpu(), b.cpu()]
    group = SwapTensors([a, b])
    group.swap_to_host()
    device_knobs.fail_nth_resize(2)
    with pytest.raises(RuntimeError):
        group.wait_d2h()
    assert group.stat == "device"  # the first storage got its bytes back from the host copy
    swap_pass.reset()
    for t, ref in zip((a, b), expected, strict=True):
        assert t.untyped_storage().nbytes() == ref.nbytes
        assert torch.equal(t.cpu(), ref)


def test_a_storage_the_device_cannot_resize_is_kept_and_counted(dev) -> None:
    a = torch.arange(float(N), device=dev)
    expected = a.cpu()
    device_knobs.mark_not_resizable(a)
    with pytest.warns(RuntimeWarning, match="marks its storage not resizable"):
        group = SwapTensors([a])
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(a.cpu(), expected)
    assert swap_pass.swap_stats().skipped_bytes["non_resizable"] == a.nbytes


def test_host_bytes_in_use_counts_the_pinned_bytes(dev) -> None:
    swap_pass.reset()
    device_knobs.empty_cache()
    before = device_knobs.pinned_stats()["pinned_bytes_in_use"]
    x = torch.randn(1_000_003, device=dev)  # 4,000,012 bytes: not a power of two
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    pinned = device_knobs.pinned_stats()["pinned_bytes_in_use"] - before
    assert pinned == 4_194_304
    assert swap_pass.swap_stats().host_bytes_in_use == pinned


def test_a_tensor_swapped_with_its_producer_stream_round_trips_exactly(dev) -> None:
    """Swapped with ``compute_stream=`` the stream that allocated it, the free is ordered there:
    that stream's next allocation cannot take the block under the copy out."""
    compute = torch.accelerator.current_stream(dev)
    producer = torch.Stream(device=dev)
    src = torch.arange(float(16 * N), device=dev)
    producer.wait_stream(compute)
    with producer:
        x = src * 1  # allocated from the producer stream's pool
    with producer:
        expected = x.to("cpu")
    group = SwapTensors([x], compute_stream=producer)
    group.swap_to_host()
    group.wait_d2h()
    assert x.untyped_storage().nbytes() == 0
    with producer:
        later = torch.full((16 * N,), 7.0, device=dev)  # the producer's next allocation
    group.swap_to_device()
    group.wait_h2d()
    with producer:
        assert torch.equal(later.to("cpu"), torch.full((16 * N,), 7.0))
        assert torch.equal(x.to("cpu"), expected)


def test_a_tensor_produced_on_another_stream_round_trips_exactly(dev) -> None:
    """Swapped without ``compute_stream=``, the free is ordered on the stream current when the
    swap began, while the block goes back to the pool of the stream that allocated it (here
    another stream): the copy out recorded its stream on the storage, so that stream's next
    allocation cannot take the block before the copy ran (see Note: [Frees on the allocating
    stream] in ``swap_pass/runtime/device.py``)."""
    unordered = device_knobs.memory_stats().get("unordered_frees", 0)
    compute = torch.accelerator.current_stream(dev)
    producer = torch.Stream(device=dev)
    src = torch.arange(float(16 * N), device=dev)
    producer.wait_stream(compute)
    with producer:
        x = src * 1  # allocated from the producer stream's pool
    compute.wait_stream(producer)
    expected = x.cpu()
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    assert x.untyped_storage().nbytes() == 0
    with producer:
        later = torch.full((16 * N,), 7.0, device=dev)  # the producer's next allocation
    compute.wait_stream(producer)
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(later.cpu(), torch.full((16 * N,), 7.0))
    assert torch.equal(x.cpu(), expected)
    assert device_knobs.memory_stats().get("unordered_frees", 0) == unordered


def test_a_backend_without_generic_streams_falls_back_to_its_module_or_says_why(
        dev, monkeypatch) -> None:
    """Older torch_npu cannot make ``torch.Stream(device="npu")`` (no ``getNewStream``): the
    device module's ``Stream`` is used instead, and where it is missing too the error names the
    way out."""
    from swap_pass.runtime.device import new_side_stream

    real = torch.Stream
    made = []

    def module_stream(device):
        made.append(device)
        return real(device=device)

    def no_generic_stream(*args, **kwargs):
        raise RuntimeError("getNewStream is not implemented")

    monkeypatch.setattr(torch, "Stream", no_generic_stream)
    module = getattr(torch, device_knobs.DEVICE_TYPE)
    monkeypatch.setattr(module, "Stream", module_stream, raising=False)
    stream = new_side_stream(dev)
    assert made == [dev] and isinstance(stream, real)
    monkeypatch.delattr(module, "Stream")
    with pytest.raises(RuntimeError, match=r"cannot create a side stream on swaptest:0: "
                                           r"torch.Stream\(device=...\) raised \(getNewStream is "
                                           r"not implemented\) and torch.swaptest.Stream does not "
                                           r"exist.*SwapConfig\(use_streams=False\)"):
        new_side_stream(dev)
