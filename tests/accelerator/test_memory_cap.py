"""The paths a real out-of-memory error takes, under the test accelerator's memory cap: the
capacity search's real cap, and a copy back refused by the allocator (the group stays on the
host with its data, and a later restore brings it back exactly)."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.testing import accelerator as device_knobs
from swap_pass.tools.bench.presets import get_preset
from swap_pass.tools.capacity.limits import device_memory_cap
from swap_pass.tools.capacity.measured import run_capacity

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

MIB = 2**20


@pytest.fixture
def fresh(dev):
    """No cached blocks before and after: reserved bytes count only what the test holds."""
    device_knobs.empty_cache()
    yield dev
    device_knobs.empty_cache()


def test_capacity_search_under_the_real_cap_of_the_device(fresh) -> None:
    """Every size reported ran under the cap; the next size raised out of memory (or peaked
    over the cap); recompute + swap reaches a larger batch than no swap. Copies start at once
    (the delay would only slow the search's steps)."""
    device_knobs.set_delay(False)
    cap = 24 * MIB
    report = run_capacity(get_preset("tiny").resized(seq=64), fresh, cap,
                          methods=["no_swap", "eager_swap"], limit=24)
    assert report.virtual_cap is False
    rows = {r.method: r for r in report.rows}
    for row in rows.values():
        assert row.max >= 1 and row.peak_bytes <= cap
        beyond = [p for p in row.probes if p.size == row.max + 1]
        assert row.max == 24 or (beyond and not beyond[0].fits
                                 and beyond[0].limited_by == "device"), row.probes
    assert any("out of memory" in p.reason for r in rows.values() for p in r.probes)
    assert rows["eager_swap"].max > rows["no_swap"].max
    assert rows["eager_swap"].exact is True


def test_a_copy_back_refused_by_the_cap_keeps_the_data_on_the_host(fresh) -> None:
    dev = fresh
    n = 4 * MIB // 4
    a = torch.arange(float(n), device=dev)
    expected = a.cpu()
    group = SwapTensors([a])
    group.swap_to_host()
    group.wait_d2h()
    assert a.untyped_storage().nbytes() == 0
    filler = []
    with device_memory_cap(dev, 8 * MIB):
        filler.append(torch.empty(6 * MIB, dtype=torch.uint8, device=dev))
        with pytest.raises(torch.OutOfMemoryError):
            group.swap_to_device()
        assert group.stat == "host" and a.untyped_storage().nbytes() == 0
        filler.clear()
        group.restore()  # room again: all of it comes back
    assert group.stat == "device"
    assert torch.equal(a.cpu(), expected)
    swap_pass.reset()
