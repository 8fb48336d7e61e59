"""How long copies and kernels take on the device they run on: the copy bandwidth probe of
SmartSwap's simulator and the graph's budget mode, and the clock of SmartSwap's copy time.

Note: [Timing on the device]
On CPU a copy or a matmul is synchronous: the host time of the call is the work's time. On an
accelerator the call only enqueues the work, so the host time is the enqueue (microseconds)
whatever the work costs. There the work is timed by two timing events on its stream
(``torch.Event(enable_timing=True)``), one recorded before it and one after, read with
``elapsed_time`` once the second completed. :class:`Timing` names the two methods,
:func:`timing_for` picks the device's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

import torch

from swap_pass.runtime.device import device_streams, is_async_device
from swap_pass.smart.profiler import now

__all__ = ["CopyClock", "Timing", "measure_copy_bandwidth", "time_on_device", "timing_for"]

T = TypeVar("T")


class Timing(str, enum.Enum):
    """How work is timed (see Note: [Timing on the device])."""

    HOST = "host"  # the call's host time: CPU work is synchronous
    EVENTS = "events"  # timing events on the work's stream, around the work


def timing_for(device: torch.device | str) -> Timing:
    """The method that times work on ``device``: events on an accelerator, else host time."""
    return Timing.EVENTS if is_async_device(device) else Timing.HOST


def _check_events(timing: Timing, stream: torch.Stream | None, api: str) -> None:
    if timing is Timing.EVENTS and stream is None:
        raise ValueError(
            f"swap_pass.{api}: timing={timing.value!r} got no stream (a CPU device). Events "
            "time work on an accelerator's stream; CPU work is timed with Timing.HOST.")


def _start_events(stream: torch.Stream) -> tuple[torch.Event, torch.Event]:
    """Timing events for work about to be queued on ``stream``; the first one recorded.

    ``stream`` first waits for the current stream, as the copies it times do before they
    start, so that the interval holds the work and not that wait.
    """
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
        t0 = now()
        fn()
        return now() - t0
    stream = torch.accelerator.current_stream(device) if is_async_device(device) else None
    _check_events(timing, stream, "time_on_device")
    start, end = _start_events(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class CopyClock:
    """Seconds SmartSwap's copies take in a step, timed as :class:`Timing` says.

    ``Timing.HOST`` adds the host time of each call (CPU copies are synchronous: the call is
    the copy). ``Timing.EVENTS`` brackets the copy on its side stream with timing events and
    reads them in :meth:`seconds` (see Note: [Timing on the device]): the copy's own time,
    not the microseconds its enqueue takes.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self._pending: list[tuple[torch.Event, torch.Event]] = []

    def time(self, fn: Callable[[], T], timing: Timing,
             stream: torch.Stream | None = None) -> T:
        """Call ``fn``, which queues copies on ``stream``, and count their time.

        Args:
            fn: Starts (and possibly waits for) the copies.
            timing: :class:`Timing` of the copies' device.
            stream: The stream the copies run on (``Timing.EVENTS``). Default: ``None``.

        Raises:
            ValueError: ``Timing.EVENTS`` without a stream.
        """
        if timing is Timing.HOST:
            t0 = now()
            try:
                return fn()
            finally:
                self._seconds += now() - t0
        _check_events(timing, stream, "CopyClock")
        start, end = _start_events(stream)
        try:
            return fn()
        finally:
            end.record(stream)
            self._pending.append((start, end))

    def time_copies(self, fn: Callable[[], T], device: torch.device | None, *, to_host: bool,
                    use_streams: bool = True) -> T:
        """:meth:`time` for a swap group's copies on ``device``: its side stream.

        Args:
            fn: Starts the group's copies (``swap_to_host``, ``swap_to_device``, ``restore``).
            device: The group's device (None: a group without storages, timed on the host).
            to_host: Whether the copies go device to host (else host to device).
            use_streams: ``SwapConfig.use_streams`` of the group. Default: ``True``.
        """
        timing = Timing.HOST if device is None else timing_for(device)
        if timing is Timing.HOST:
            return self.time(fn, timing)
        streams = device_streams(device, use_streams)
        return self.time(fn, timing, streams.d2h_stream() if to_host else streams.h2d_stream())

    def seconds(self, wait: bool = True) -> float:
        """Seconds counted so far.

        Args:
            wait: Wait for copies timed with events that are still running. Without it they
                are left out until a later call finds them finished: the steady state never
                waits for the device. Default: ``True``.
        """
        running = []
        for start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                running.append((start, end))
                continue
            self._seconds += start.elapsed_time(end) / 1e3
        self._pending = running
        return self._seconds


def measure_copy_bandwidth(device: torch.device, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Device-to-host copy bandwidth in bytes/s, timed on ``device`` (best of ``repeats``;
    see Note: [Timing on the device])."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = is_async_device(device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    best = min(time_on_device(lambda: dst.copy_(src, non_blocking=pinned), device)
               for _ in range(repeats))
    return nbytes / max(best, 1e-9)
