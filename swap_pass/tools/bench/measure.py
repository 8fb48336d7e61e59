"""Measurements that do not depend on the method measured: memory over a step, copy bandwidth.

Memory comes from the allocator, not from any method's own bookkeeping and without
``saved_tensors_hooks`` (several methods install their own):

* accelerator: ``torch.accelerator.max_memory_allocated`` minus the bytes allocated at the
  step's start;
* CPU: the same quantity rebuilt from ``torch.profiler`` memory events (``profile_memory=True``:
  every allocation and free of the CPU allocator, ``untyped_storage().resize_(0)`` included).
  swap_pass's host buffers come from its pool, filled during warm-up, so a steady-state step
  allocates none: the curve is what a device would hold.

Achieved copy bandwidth comes from the same profiled step: on an accelerator the device's
``Memcpy DtoH``/``Memcpy HtoD`` records (bytes and duration, from the trace); on CPU, where
copies are synchronous, swap_pass's own copies (the runtime names each one's range
``swap_pass::copy[N B]`` while the profiler records) inside the ``bench::forward`` (D2H) and
``bench::backward`` (H2D) ranges. Other methods' copies on CPU cannot
be told apart from the model's own, so their CPU bandwidth is left empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from swap_pass.runtime.device import COPY_RANGE

__all__ = ["CopyRate", "StepProfile", "anchor_bandwidth", "intra_op_threads", "profile_step",
           "quiet_profiler", "synchronize", "warm_step_peak"]

FORWARD_RANGE = "bench::forward"
BACKWARD_RANGE = "bench::backward"
_MIN_COPY_BYTES = 4096  # smaller copies are scalars (loss.item()), not activations


@dataclasses.dataclass
class CopyRate:
    """Bytes copied in one direction during a step and the time the copies took."""

    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbs(self) -> float | None:
        """Achieved GB/s (10^9 bytes per second), None when nothing was copied."""
        return self.nbytes / self.seconds / 1e9 if self.nbytes and self.seconds > 0 else None


@dataclasses.dataclass
class StepProfile:
    """Memory and copies of one profiled training step.

    Attributes:
        peak_bytes: Peak bytes allocated above the step's start.
        peak_source: Where ``peak_bytes`` comes from, in words.
        curve_ms: Times (ms since the step began) of the memory curve's points.
        curve_bytes: Bytes allocated above the step's start at those times.
        d2h: Device-to-host copies found in the step.
        h2d: Host-to-device copies found in the step.
    """

    peak_bytes: int
    peak_source: str
    curve_ms: list[float]
    curve_bytes: list[int]
    d2h: CopyRate
    h2d: CopyRate


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the body with ``n`` intra-op threads (None: leave as is), then restore the count.

    A fixed count makes runs comparable across machines; one thread also keeps a loaded machine
    from stalling every parallel kernel on the slowest of its threads.
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (nothing to wait for on CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _activities(device: torch.device) -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    elif device.type == "xpu":
        acts.append(ProfilerActivity.XPU)
    elif device.type != "cpu" and hasattr(ProfilerActivity, "PrivateUse1"):
        acts.append(ProfilerActivity.PrivateUse1)
    return acts


def _memory_curve(events: list, device: torch.device, t0: int) -> tuple[list[float], list[int]]:
    """Cumulative bytes allocated on ``device`` from the profiler's memory events."""
    want = torch.device(device).type
    times, values, level = [0.0], [0], 0
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    for e in mem:
        if str(e.device_type()).split(".")[-1].lower() != want:
            continue
        level += e.nbytes()
        times.append((e.start_ns() - t0) / 1e6)
        values.append(level)
    return times, values


def _ranges(events: list) -> dict[str, tuple[int, int]]:
    out = {}
    for e in events:
        if e.name() in (FORWARD_RANGE, BACKWARD_RANGE):
            out[e.name()] = (e.start_ns(), e.start_ns() + e.duration_ns())
    return out


_COPY_RANGE = re.compile(re.escape(COPY_RANGE) + r"\[(\d+) B\]")


def _cpu_swap_copies(events: list) -> tuple[CopyRate, CopyRate]:
    """swap_pass's copies on CPU (the runtime's ``swap_pass::copy[N B]`` ranges), split into
    forward (D2H) and backward (H2D)."""
    spans = _ranges(events)
    rates = {FORWARD_RANGE: CopyRate(), BACKWARD_RANGE: CopyRate()}
    for e in events:
        match = _COPY_RANGE.fullmatch(e.name())
        if match is None:
            continue
        nbytes = int(match.group(1))
        for name, (lo, hi) in spans.items():
            if lo <= e.start_ns() <= hi and nbytes >= _MIN_COPY_BYTES:
                rates[name].nbytes += nbytes
                rates[name].seconds += e.duration_ns() / 1e9
    return rates[FORWARD_RANGE], rates[BACKWARD_RANGE]


def _device_copies(prof: profile) -> tuple[CopyRate, CopyRate]:
    """Device memcpy records (bytes and duration) read from the exported trace."""
    d2h, h2d = CopyRate(), CopyRate()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    for ev in trace.get("traceEvents", []):
        name, nbytes = ev.get("name", ""), ev.get("args", {}).get("bytes", 0)
        if ev.get("cat") != "gpu_memcpy" or nbytes < _MIN_COPY_BYTES:
            continue
        rate = d2h if "DtoH" in name else h2d if "HtoD" in name else None
        if rate is not None:
            rate.nbytes += nbytes
            rate.seconds += ev.get("dur", 0) / 1e6
    return d2h, h2d


def _device_start(device: torch.device) -> int:
    """Bytes allocated on ``device`` now; its peak counter restarts from here."""
    if device.type == "cpu":
        return 0
    start = torch.accelerator.memory_allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    return start


# Kineto prints "USDT: ... profiler_start" / "profiler_stop" and "STAGE: ... Completed Stage"
# lines from C++ for every profiled region, whatever KINETO_LOG_LEVEL says. They may follow text
# with no newline of its own (a progress bar redrawn with "\r"), so they are cut wherever they
# start.
_PROFILER_CHATTER = re.compile(r"(USDT|STAGE):[^\n]*(profiler_st(art|op)|Completed Stage)[^\n]*\n?")


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Drop kineto's start/stop lines from file descriptors 1 and 2; pass every other line on."""
    saved, files = [], []
    try:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            tmp = tempfile.TemporaryFile(mode="w+b")
            saved.append((fd, os.dup(fd), stream))
            files.append(tmp)
            os.dup2(tmp.fileno(), fd)
    except (OSError, ValueError, AttributeError):  # no real descriptors (captured streams)
        _restore(saved, files, replay=False)
        yield
        return
    try:
        yield
    finally:
        _restore(saved, files, replay=True)


def _restore(saved: list, files: list, replay: bool) -> None:
    for (fd, copy, stream), tmp in zip(saved, files, strict=True):
        stream.flush()
        os.dup2(copy, fd)
        os.close(copy)
        if replay:
            tmp.seek(0)
            stream.write(_PROFILER_CHATTER.sub("", tmp.read().decode(errors="replace")))
            stream.flush()
        tmp.close()


def profile_step(device: torch.device, step: Callable[[], None]) -> StepProfile:
    """Run ``step`` once under the profiler and return its memory curve and copies."""
    synchronize(device)
    start = _device_start(device)
    with quiet_profiler(), profile(activities=_activities(device), profile_memory=True,
                                   record_shapes=True) as prof:
        step()
        synchronize(device)
    events = prof.profiler.kineto_results.events()
    t0 = min((e.start_ns() for e in events if e.name() == FORWARD_RANGE), default=0)
    times, values = _memory_curve(events, device, t0)
    if device.type == "cpu":
        d2h, h2d = _cpu_swap_copies(events)
        peak, source = (max(values),
                        "CPU allocator bytes above step start (torch.profiler memory events)")
    else:
        d2h, h2d = _device_copies(prof)
        peak = torch.accelerator.max_memory_allocated(device) - start
        source = "torch.accelerator.max_memory_allocated above step start"
    return StepProfile(peak, source, times, values, d2h, h2d)


def warm_step_peak(device: torch.device, step: Callable[[], None],
                   zero_grad: Callable[[], None]) -> int:
    """Peak bytes of one profiled ``step`` (:func:`profile_step`) after a warm-up run of it.

    The warm-up fills swap_pass's host pool (and compiles, for a compiled step), so the profiled
    step allocates no host buffer and its peak is the device side's; ``zero_grad`` runs between
    the two so that the warm-up's gradients are not counted.

    Raises:
        RuntimeError: the profiled step allocated a host buffer after all.
    """
    from swap_pass import swap_stats

    step()
    zero_grad()
    allocations = swap_stats().host_allocations
    peak = profile_step(device, step).peak_bytes
    if swap_stats().host_allocations != allocations:
        raise RuntimeError(
            "swap_pass.tools.bench.warm_step_peak: the profiled step allocated host buffers after "
            "a warm-up step; its peak would count them. The step must swap the same tensors each "
            "time."
        )
    return peak


def _seconds(copy_all: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    t = time.perf_counter()
    copy_all()
    synchronize(device)
    return time.perf_counter() - t


def anchor_bandwidth(device: torch.device, chunk_bytes: int, chunks: int,
                     reps: int = 9) -> tuple[float, float]:
    """GB/s of a plain copy of ``chunks`` buffers of ``chunk_bytes`` each way (D2H, H2D).

    On an accelerator: device buffers to pinned host buffers and back, one stream, no compute.
    On CPU: a plain ``memcpy`` between two CPU buffers (there is no second memory). One warm-up,
    then ``reps`` pairs (a D2H pass then an H2D pass, so load that comes and goes hits both);
    each direction's figure is the median over its passes. Default ``reps``: ``9``.
    """
    pin = device.type != "cpu"
    dev = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(chunks)]
    host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(chunks)]
    total = chunk_bytes * chunks

    def d2h() -> None:
        for h, d in zip(host, dev, strict=True):
            h.copy_(d, non_blocking=pin)

    def h2d() -> None:
        for h, d in zip(host, dev, strict=True):
            d.copy_(h, non_blocking=pin)

    d2h(), h2d()  # warm-up: first touch of the pages
    pairs = [(_seconds(d2h, device), _seconds(h2d, device)) for _ in range(reps)]
    return (total / statistics.median(p[0] for p in pairs) / 1e9,
            total / statistics.median(p[1] for p in pairs) / 1e9)
