"""Runtime-level stream races, shown under the CPU stream model: pinned buffer reuse, one storage
in two groups."""

from __future__ import annotations

import pytest
import torch

from swap_pass import SwapTensors
from swap_pass.runtime.device import device_streams
from swap_pass.runtime.host_pool import host_pool
from swap_pass.testing import stream_model

pytestmark = pytest.mark.no_stream_model  # each test runs its own model


def test_a_reused_host_buffer_waits_for_its_last_copy():
    """Another stream's H2D still reads a released buffer; the next D2H that takes it waits."""
    with stream_model(early_probability=0.0) as model:
        ds, other = device_streams("cpu"), model.new_stream("other-thread")
        buf = host_pool().acquire(256, pin=False)
        buf.copy_(torch.arange(256, dtype=torch.uint8))
        restored = torch.empty(256, dtype=torch.uint8)
        ds.copy(other, restored, buf)  # an H2D on a stream nobody here waited on
        host_pool().release(buf, ds.record_event(other))
        x = torch.full((64,), 3.0)  # 256 bytes: takes the same buffer
        group = SwapTensors([x])
        group.swap_to_host()
        group.wait_d2h()
        group.swap_to_device()
        group.wait_h2d()
        assert torch.equal(restored, torch.arange(256, dtype=torch.uint8))
        assert torch.equal(x, torch.full((64,), 3.0))
    assert not model.hazards


@pytest.mark.parametrize("seed", range(3))
def test_one_storage_in_two_groups_is_copied_once_and_exact(seed):
    """A layer returning its input: both groups hold x; the older one gives it up."""
    x = torch.randn(64)
    expected = x.clone()
    with stream_model(seed=seed) as model:
        first, second = SwapTensors([x], name="layers[0]"), SwapTensors([x], name="layers[1]")
        first.swap_to_host()
        second.swap_to_host()  # takes x over while first's copy may still run
        first.wait_d2h()       # frees nothing now
        kept_after_first = x.untyped_storage().nbytes()
        second.wait_d2h()
        freed_after_second = x.untyped_storage().nbytes() == 0
        second.swap_to_device()
        second.wait_h2d()
        first.swap_to_device()
        first.wait_h2d()
        assert torch.equal(x, expected) and not model.hazards, model.hazards
    assert kept_after_first == x.numel() * 4 and first.is_empty and freed_after_second
