"""SmartSwap's copy clock: the seconds its copies take in a step.

The clock it reads (``Timing``, ``timing_for``) lives in :mod:`swap_pass.cost_probes`, which
budget mode reads too (see Note: [Timing on the device] there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from swap_pass.cost_probes import Timing, check_events, start_events, timing_for
from swap_pass.runtime import stats
from swap_pass.runtime.device import device_streams
from swap_pass.smart.profiler import now

__all__ = ["CopyClock"]

T = TypeVar("T")


# Note: [One timed copy a step]
# Reading a pair of timing events costs little on CUDA, but torch_npu's ``elapsed_time`` flushes
# every task queue and synchronizes both events: a host stall per call. Timing every copy of a
# step would stall once per swapped tensor. So on an accelerator the clock brackets only the
# first copy call of each period (from one :meth:`CopyClock.seconds` to the next, a step) that
# moves bytes, and counts the bytes of every other call (the runtime's swap counters around
# it). :meth:`CopyClock.seconds` reads the one pair and scales: the sampled copy's seconds per
# byte times every byte copied in the period. One ``elapsed_time`` per step, read once the
# sampled copy completed (a steady-state step never waits for it: it is read at a later step).
# Copies of one step are layer inputs of one size on one link, so the sample's rate stands
# for the others; the copy time is a planning figure, not a measurement of each copy.


class CopyClock:
    """Seconds SmartSwap's copies take in a step, timed as :class:`Timing` says.

    ``Timing.HOST`` adds the host time of each call (CPU copies are synchronous: the call is
    the copy). ``Timing.EVENTS`` brackets one copy call a step on its side stream with timing
    events, counts the bytes of the others, and reads the pair in :meth:`seconds` (see Note:
    [One timed copy a step], Note: [Timing on the device] in :mod:`swap_pass.cost_probes`): the
    copies' own time, not the microseconds their enqueue takes.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        # the sampled call: its events and bytes (None: none yet this period)
        self._sample: tuple[torch.Event, torch.Event, int] | None = None
        self._other_bytes = 0  # bytes of the period's calls not sampled

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
        check_events(timing, stream, "CopyClock")
        before = stats.bytes_copied()
        if self._sample is not None:  # this period's copy is sampled already
            try:
                return fn()
            finally:
                self._other_bytes += stats.bytes_copied() - before
        start, end = start_events(stream)
        try:
            return fn()
        finally:
            end.record(stream)
            nbytes = stats.bytes_copied() - before
            if nbytes > 0:  # a call that copied nothing times nothing
                self._sample = (start, end, nbytes)

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
        """Seconds counted so far; ends the period whose copy was sampled.

        Args:
            wait: Wait for the sampled copy if it is still running. Without it, a copy still
                running leaves the period open (its bytes are counted once a later call finds
                it finished): the steady state never waits for the device. Default: ``True``.
        """
        if self._sample is None:
            return self._seconds
        start, end, nbytes = self._sample
        if wait:
            end.synchronize()
        elif not end.query():
            return self._seconds
        per_byte = start.elapsed_time(end) / 1e3 / nbytes  # the period's one elapsed_time
        self._seconds += per_byte * (nbytes + self._other_bytes)
        self._sample, self._other_bytes = None, 0
        return self._seconds
