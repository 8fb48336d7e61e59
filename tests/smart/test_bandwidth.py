"""How copies and the budget probe are timed: host time on CPU, where copies are synchronous;
timing events on the work's stream on an accelerator, where a call only enqueues the work.

See Note: [Timing on the device] in ``swap_pass/cost/probes.py`` and Note: [One timed copy a
step] in ``swap_pass/smart/executor.py``.
"""

from __future__ import annotations

import pytest
import torch

from swap_pass import SmartSwap, SwapTensors
from swap_pass.cost.probes import Timing, measure_copy_bandwidth, time_on_device, timing_for
from swap_pass.smart.executor import CopyClock
from tests.conftest import ACCELERATOR, HAS_ACCELERATOR, NO_ACCELERATOR_REASON
from tests.smart.helpers import Pair


def test_cpu_work_is_timed_on_the_host():
    assert timing_for("cpu") is Timing.HOST and timing_for(torch.device("cpu")) is Timing.HOST
    assert measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20) > 0


def test_timing_events_need_an_accelerator_stream():
    with pytest.raises(ValueError, match=r"swap_pass\.CopyClock: timing='events' got no stream "
                                         r"\(a CPU device\)\. Events time work on an accelerator"):
        CopyClock().time(lambda: None, Timing.EVENTS)
    with pytest.raises(ValueError, match=r"swap_pass\.time_on_device: timing='events' got no"):
        time_on_device(lambda: None, "cpu", Timing.EVENTS)


def test_smartswap_times_cpu_copies_on_the_host():
    """A profiled step's copy time on CPU is the host time of the executor's copy calls, as
    before the accelerator got its own clock."""
    pair = Pair()
    with SmartSwap(pair.model, memory_budget=0.5) as smart:
        for _ in range(2):  # warmup, then the profiled step that plans
            pair.step(smart)
    assert smart.last_profile is not None and smart.last_profile.transfer_s > 0


# --- an accelerator only ---------------------------------------------------------------------


@pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)
def test_a_side_stream_copy_is_timed_by_its_events():
    device = torch.device(ACCELERATOR)
    assert timing_for(device) is Timing.EVENTS
    x = torch.randn(16 << 20, device=device)  # 64 MiB: milliseconds of copy, microseconds to queue
    ref = x.clone()
    group = SwapTensors([x])
    clock = CopyClock()
    clock.time_copies(group.swap_to_host, device, to_host=True)
    group.wait_d2h()
    assert x.untyped_storage().nbytes() == 0 and clock.seconds() > 0
    clock.time_copies(group.swap_to_device, device, to_host=False)
    group.wait_h2d()
    assert torch.equal(x, ref) and clock.seconds() > 0


@pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)
def test_smartswap_times_accelerator_copies_by_their_events():
    pair = Pair(device=ACCELERATOR)
    with SmartSwap(pair.model, memory_budget=0.5) as smart:
        for _ in range(2):  # warmup, then the profiled step that plans
            pair.step(smart)
    assert smart.last_profile is not None and smart.last_profile.transfer_s > 0
    assert measure_copy_bandwidth(torch.device(ACCELERATOR)) > 0
