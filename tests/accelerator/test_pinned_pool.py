"""The pinned buffer pool on a device: blocks shared by changing sequence lengths, a default
bound without ``max_host_bytes``, and no call that can synchronize the device inside a step
(see Notes [One bucket per block], [The pool's default bound] and [Nothing that can
synchronize] in ``swap_pass/runtime/host_pool.py``)."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig, SwapTensors
from swap_pass.runtime.host_pool import host_pool
from swap_pass.testing import accelerator as device_knobs

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

MIB = 1 << 20
HIDDEN, LAYERS = 1024, 4
# Token counts of eight steps: layer inputs of 2.0 to 3.2 MB, pinned in 2 and 4 MiB blocks.
LENGTHS = [500, 512, 530, 541, 600, 613, 700, 777]


def _step(dev: torch.device, seq: int, layers: int = LAYERS,
          config: SwapConfig | None = None) -> None:
    """A forward that swaps ``layers`` inputs of ``seq`` tokens out, and a backward that brings
    them back in reverse, checked bitwise against copies kept aside."""
    xs = [torch.randn(seq, HIDDEN, device=dev) for _ in range(layers)]
    expected = [x.cpu() for x in xs]
    groups = [SwapTensors([x], config=config) for x in xs]
    for g, x in zip(groups, xs, strict=True):
        g.swap_to_host()
        g.wait_d2h()
        assert x.untyped_storage().nbytes() == 0
    for g in reversed(groups):
        g.swap_to_device()
        g.wait_h2d()
    for x, ref in zip(xs, expected, strict=True):
        assert torch.equal(x.cpu(), ref)


def test_changing_lengths_share_pinned_blocks_and_stay_bounded(dev) -> None:
    swap_pass.reset()
    device_knobs.set_delay(False)
    pinned_before = device_knobs.pinned_stats()["pinned_bytes_reserved"]
    largest_step = LAYERS * 4 * MIB  # four 777-token inputs: four 4 MiB blocks
    for seq in LENGTHS:
        _step(dev, seq)
        device_knobs.synchronize()
        pinned = device_knobs.pinned_stats()["pinned_bytes_reserved"] - pinned_before
        assert pinned <= 2 * largest_step, seq
    # Two block sizes for eight lengths: 4 x 2 MiB and 4 x 4 MiB, where exact sizes held 112 MiB.
    assert host_pool().bytes_reserved == pinned == 24 * MIB
    assert swap_pass.swap_stats().host_pool_bound_bytes == host_pool().bound_bytes
    assert host_pool().bound_bytes == 2 * largest_step
    swap_pass.reset()
    assert host_pool().bytes_reserved == 0
    assert device_knobs.pinned_stats()["pinned_bytes_reserved"] <= pinned_before


def test_a_length_seen_before_allocates_nothing(dev) -> None:
    swap_pass.reset()
    device_knobs.set_delay(False)
    _step(dev, 777)
    swap_pass.swap_stats()  # drains what finalizers queued
    swap_pass.runtime.stats.clear()  # host_allocations counts from here
    for seq in (530, 600, 700, 777):  # all within the 4 MiB blocks of the first step
        _step(dev, seq)
    assert swap_pass.swap_stats().host_allocations == 0


def test_a_capped_pool_never_empties_the_host_cache_inside_a_step(dev, monkeypatch) -> None:
    """Evicting under max_host_bytes only drops the pool's buffers; empty_host_cache (which
    frees every idle pinned block of the process, a device-wide wait on CUDA) runs at reset."""
    swap_pass.reset()
    device_knobs.set_delay(False)
    calls = []
    real = torch.accelerator.empty_host_cache
    monkeypatch.setattr(torch.accelerator, "empty_host_cache",
                        lambda: (calls.append(1), real())[1])
    config = SwapConfig(max_host_bytes=16 * MIB)
    for seq in (700, 1500, 700, 1500):  # 2 x 4 MiB, then 2 x 8 MiB: each evicts the other
        _step(dev, seq, layers=2, config=config)
        assert swap_pass.swap_stats().host_bytes_reserved <= 16 * MIB
    assert swap_pass.swap_stats().host_allocations == 7  # 4 blocks, 3 again after evictions
    assert calls == []
    swap_pass.reset()
    assert len(calls) >= 1


@pytest.mark.parametrize("seq", [100, 2000])
def test_a_view_of_a_larger_block_restores_exactly(dev, seq) -> None:
    """A request smaller than its block copies only its own bytes, whatever the block held."""
    swap_pass.reset()
    _step(dev, 4000, layers=1)  # leaves a 16 MiB block cached
    _step(dev, seq, layers=1)
