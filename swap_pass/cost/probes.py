"""Cost probes: how fast this process's devices copy to the host and multiply matrices.

    copy_bandwidth(device)        bytes/s of a 16 MiB device-to-host copy      measured once
    flop_rate(device, dtype)      FLOP/s of a square matmul in ``dtype``       measured once
    measure_copy_bandwidth(...)   the copy probe itself (every call measures)
    measure_flops(...)            the matmul probe itself (every call measures)
    time_on_device(fn, device)    the clock both read (Note: [Timing on the device])

Budget mode (:mod:`swap_pass.graph.budget`) plans with :func:`copy_bandwidth` and
:func:`flop_rate` inside ``torch.compile``; SmartSwap (:mod:`swap_pass.smart`) times its copies
with :func:`time_on_device` and measures its link with :func:`measure_copy_bandwidth`.

Note: [Timing on the device]
On CPU a copy or a matmul is synchronous: the call's host time is the work's. On an accelerator
the call only enqueues the work (microseconds, whatever it costs), so two timing events on its
stream (``torch.Event(enable_timing=True)``) bracket it, read with ``elapsed_time`` once the
second completed. :class:`Timing` names the two methods, :func:`timing_for` picks the device's.

Note: [Probes run on real tensors]
AOTAutograd runs the partitioner, and with it budget mode's plan, under its ``FakeTensorMode``.
A probe there makes FakeTensors that do no work: the rates come out 10-100x too fast (budget
mode then counts on compute windows that are not there). So every probe runs inside
:func:`real_tensors`: the fake mode unset, every other dispatch mode (proxy, functionalization,
a user's) popped, no tracing context, autocast and autograd off; a probe whose tensors are still
not plain tensors raises instead of returning a rate it did not measure.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterator

import torch

from swap_pass.runtime.device import is_async_device
from swap_pass.state import pending_rates as _pending
from swap_pass.state import rates as _rates
from swap_pass.state import rates_lock as _rates_lock

__all__ = [
    # the clock
    "Timing",
    "time_on_device",
    "timing_for",
    # the probes
    "PROBE_SIDE",
    "measure_copy_bandwidth",
    "measure_flops",
    "probe_side",
    "real_tensors",
    # measured once per process
    "clear_measured_rates",
    "copy_bandwidth",
    "flop_rate",
    "measured_rates",
]


# --- the clock ----------------------------------------------------------------------------------


class Timing(str, enum.Enum):
    """How work is timed (see Note: [Timing on the device])."""

    HOST = "host"  # the call's host time: CPU work is synchronous
    EVENTS = "events"  # timing events on the work's stream, around the work


def timing_for(device: torch.device | str) -> Timing:
    """The method that times work on ``device``: events on an accelerator, else host time."""
    return Timing.EVENTS if is_async_device(device) else Timing.HOST


def check_events(timing: Timing, stream: torch.Stream | None, api: str) -> None:
    """Raise unless ``timing`` can time work on ``stream`` (events need an accelerator's)."""
    if timing is Timing.EVENTS and stream is None:
        raise ValueError(
            f"swap_pass.{api}: timing={timing.value!r} got no stream (a CPU device). Events "
            "time work on an accelerator's stream; CPU work is timed with Timing.HOST.")


def start_events(stream: torch.Stream) -> tuple[torch.Event, torch.Event]:
    """Timing events for work about to be queued on ``stream``, the first recorded once
    ``stream`` waits for the current stream (as the timed copies do): the interval holds the
    work, not that wait."""
    current = torch.accelerator.current_stream(stream.device)
    if stream != current:
        ready = torch.Event(device=stream.device)
        ready.record(current)
        stream.wait_event(ready)
    start = torch.Event(device=stream.device, enable_timing=True)
    end = torch.Event(device=stream.device, enable_timing=True)
    start.record(stream)
    return start, end


def time_on_device(fn: Callable[[], object], device: torch.device | str,
                   timing: Timing | None = None) -> float:
    """Seconds ``fn``'s work on ``device`` takes, waiting for it to complete.

    Args:
        fn: Queues the work on ``device``'s current stream.
        device: Where the work runs.
        timing: How to time it. Default: ``None`` (:func:`timing_for` ``device``).

    Raises:
        ValueError: ``Timing.EVENTS`` on a CPU device.
    """
    timing = timing_for(device) if timing is None else timing
    if timing is Timing.HOST:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    stream = torch.accelerator.current_stream(device) if is_async_device(device) else None
    check_events(timing, stream, "time_on_device")
    start, end = start_events(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# --- the probes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Run the body on real tensors, outside any compiler's tracing
    (Note: [Probes run on real tensors])."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), tracing(None), \
            torch._C._DisableAutocast(), torch.no_grad():
        yield


def _check_real(tensors: tuple[torch.Tensor, ...], api: str) -> None:
    kinds = sorted({type(t).__name__ for t in tensors if type(t) is not torch.Tensor})
    if kinds:
        raise RuntimeError(
            f"swap_pass.{api}: the probe's tensors are {kinds}, not plain tensors, although "
            "the compiler's modes were unset. A cost probe must time real work on the device.")


def measure_copy_bandwidth(device: torch.device, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Device-to-host copy bandwidth in bytes/s, timed on ``device`` on real tensors (best of
    ``repeats``; see Note: [Timing on the device] and Note: [Probes run on real tensors]).

    Raises:
        RuntimeError: The probe's tensors are not plain tensors.
    """
    with real_tensors():
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = is_async_device(device)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        _check_real((src, dst), "measure_copy_bandwidth")
        best = min(time_on_device(lambda: dst.copy_(src, non_blocking=pinned), device)
                   for _ in range(repeats))
    return nbytes / max(best, 1e-9)


# Note: [Throughput probe]
# Budget mode compares compute time with copy time, so the FLOP rate must be the graph's. On an
# accelerator a 512x512 fp32 matmul measures launch latency and fp32 (an H200 in bf16 is 30-100x
# faster), and budget mode would count on compute windows that are not there. So the probe
# multiplies square matrices in the graph's matmul dtype (tensor-core bf16 for a bf16 model) of a
# side reaching the device's peak (4096: 137 GFLOP, under a millisecond, 96 MiB in bf16): one
# warm-up, then the best of three, timed with events. On CPU 512 keeps it short (about 10 ms in
# fp32 on two cores).

PROBE_SIDE = {"cpu": 512, "accelerator": 4096}


def probe_side(device: torch.device) -> int:
    """The side of the square matmul the FLOP rate probe times on ``device``."""
    return PROBE_SIDE["accelerator" if is_async_device(device) else "cpu"]


def measure_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                  n: int | None = None, repeats: int = 3) -> float:
    """Achieved matmul FLOP/s on ``device`` in ``dtype``, on real tensors (see Note: [Throughput
    probe] and Note: [Probes run on real tensors]).

    Args:
        device: Where the probe runs.
        dtype: The matmuls' dtype (not a floating dtype: ``float32``). Default: ``float32``.
        n: The side of the square matrices. Default: ``None`` (:func:`probe_side`).
        repeats: Timed runs after one warm-up; the best counts. Default: ``3``.

    Raises:
        RuntimeError: The probe's tensors are not plain tensors.
    """
    n = n or probe_side(device)
    dtype = dtype if dtype.is_floating_point else torch.float32
    with real_tensors():
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        _check_real((a, b), "measure_flops")
        time_on_device(lambda: a @ b, device)  # library set-up, kernel choice
        best = min(time_on_device(lambda: a @ b, device) for _ in range(repeats))
    return 2 * n**3 / max(best, 1e-9)


# --- measured once per process ------------------------------------------------------------------

# Note: [Measured rates]
# ``state.rates`` holds every rate :func:`copy_bandwidth` and :func:`flop_rate` measured in this
# process, on their first call for a key: (what, device, dtype, CPU threads), "copy" (dtype None)
# or "flops"; a CPU matmul's rate follows ``torch.get_num_threads()``. The rates describe the
# machine, not any swap's state, so ``swap_pass.reset()`` keeps them (a compile after a reset
# probes nothing); only :func:`clear_measured_rates` empties it, for tests and for a process whose
# device clocks or thread count changed. The probe runs outside ``state.rates_lock`` (it waits
# for the device, and nothing that can synchronize a device runs under a lock); a second thread
# wanting the same key waits on the first one's ``threading.Event`` (``state.pending_rates``) and
# reads its rate, so a key is probed once. If the first probe raises, the waiting thread probes.

_Key = tuple[str, torch.device, torch.dtype | None, int | None]


def _key(what: str, device: torch.device | str, dtype: torch.dtype | None) -> _Key:
    device = torch.device(device)
    if is_async_device(device) and device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    threads = None if is_async_device(device) else torch.get_num_threads()
    return what, device, dtype, threads


def _measured_once(key: _Key, probe: Callable[[], float]) -> float:
    """The rate stored under ``key``, probed first if none is (Note: [Measured rates])."""
    while True:
        with _rates_lock:
            if key in _rates:
                return _rates[key]
            pending, mine = _pending.get(key), key not in _pending
            if mine:
                pending = _pending[key] = threading.Event()
        if not mine:
            pending.wait()
            continue
        try:
            rate = probe()
            with _rates_lock:
                _rates[key] = rate
            return rate
        finally:
            with _rates_lock:
                del _pending[key]
            pending.set()


def copy_bandwidth(device: torch.device | str) -> float:
    """Device-to-host bytes/s on ``device``, measured once per process (Note: [Measured rates])."""
    key = _key("copy", device, None)
    return _measured_once(key, lambda: measure_copy_bandwidth(key[1]))


def flop_rate(device: torch.device | str, dtype: torch.dtype = torch.float32) -> float:
    """Matmul FLOP/s on ``device`` in ``dtype``, measured once (Note: [Measured rates])."""
    dtype = dtype if dtype.is_floating_point else torch.float32
    key = _key("flops", device, dtype)
    return _measured_once(key, lambda: measure_flops(key[1], dtype))


def measured_rates() -> dict[_Key, float]:
    """A copy of the rates measured so far: ``(what, device, dtype, cpu_threads) -> rate``,
    ``what`` being ``"copy"`` (bytes/s, dtype None) or ``"flops"`` (FLOP/s)."""
    with _rates_lock:
        return dict(_rates)


def clear_measured_rates() -> None:
    """Forget every measured rate: the next call for each probes again (Note: [Measured rates])."""
    with _rates_lock:
        _rates.clear()
