"""On the test accelerator with its default settings, the two orderings a swap depends on give
wrong numbers when broken (a free before the device-to-host copy's event; a read of a
host-to-device destination before its wait) and the runtime's own order is exact."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig, SwapTensors

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

N = 64 * 1024


def _values(dev: torch.device) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32, device=dev)


def _swap_out_by_hand(x: torch.Tensor, wait_before_free: bool) -> torch.Tensor:
    """Copy ``x`` to pinned memory on a side stream and free its storage; then let compute take
    the freed block (the next layer's activations). Returns the host copy."""
    compute = torch.accelerator.current_stream(x.device)
    side = torch.Stream(device=x.device)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    side.wait_stream(compute)
    with side:
        host.copy_(x, non_blocking=True)
    copied = side.record_event()
    if wait_before_free:
        compute.wait_event(copied)
    x.untyped_storage().resize_(0)
    next_layer = torch.full((N,), 7.0, device=x.device)  # reuses the freed block at once
    copied.synchronize()
    del next_layer
    return host


def _swap_in_by_hand(host: torch.Tensor, dev: torch.device, wait_before_read: bool):
    compute = torch.accelerator.current_stream(dev)
    side = torch.Stream(device=dev)
    dst = torch.empty(host.shape, dtype=host.dtype, device=dev)
    side.wait_stream(compute)
    with side:
        dst.copy_(host, non_blocking=True)
    copied = side.record_event()
    if wait_before_read:
        compute.wait_event(copied)
    read = (dst * 1).cpu()  # the first reader, on the compute stream
    copied.synchronize()
    return read


@pytest.mark.unordered_on_purpose
def test_a_free_before_the_d2h_event_gives_wrong_numbers(dev) -> None:
    expected = _values(dev).cpu()
    host = _swap_out_by_hand(_values(dev), wait_before_free=False)
    assert not torch.equal(host, expected)


def test_the_free_after_the_d2h_event_is_exact(dev) -> None:
    expected = _values(dev).cpu()
    host = _swap_out_by_hand(_values(dev), wait_before_free=True)
    assert torch.equal(host, expected)


@pytest.mark.unordered_on_purpose
def test_a_read_before_the_h2d_wait_gives_wrong_numbers(dev) -> None:
    host = torch.arange(N, dtype=torch.float32).pin_memory()
    assert not torch.equal(_swap_in_by_hand(host, dev, wait_before_read=False), host)


def test_the_read_after_the_h2d_wait_is_exact(dev) -> None:
    host = torch.arange(N, dtype=torch.float32).pin_memory()
    assert torch.equal(_swap_in_by_hand(host, dev, wait_before_read=True), host)


@pytest.mark.parametrize("use_streams", [True, False], ids=["streams", "no_streams"])
def test_swap_tensors_round_trip_is_exact_while_compute_reuses_the_blocks(dev, use_streams):
    tensors = [_values(dev), _values(dev).view(256, 256)[3:, 1:].t()]
    expected = [t.cpu() for t in tensors]
    group = SwapTensors(tensors, config=SwapConfig(use_streams=use_streams))
    group.swap_to_host()
    group.wait_d2h()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    other = torch.full((N,), 7.0, device=dev)  # takes a freed block, overwrites it
    group.swap_to_device()
    group.wait_h2d()
    assert all(torch.equal(t.cpu(), ref) for t, ref in zip(tensors, expected, strict=True))
    assert torch.equal(other.cpu(), torch.full((N,), 7.0))
    swap_pass.reset()
