"""Timing and memory model of one training step with swapping, per logical layer (group).

Pattern it models (``G`` groups, forward then backward in reverse)::

    compute:  F0 F1 .. F(G-1) | B(G-1) .. B1 B0
    d2h:         o0 o1 ..           (group i leaves after F(i); freed once its copy is done,
                                     the compute stream waits for it at the end of F(i+1))
    h2d:                      i(j-d) ... (group j's copy is issued when B(j+d) starts, FIFO;
                                     B(j) waits for it)

A plain function of numbers (no tensors), so that ``swap-pass plan`` and the SmartSwap policy
can ask "what stall and what peak would this choice give" without running the model; a copy
takes :func:`swap_pass.memory_model.copy_seconds`, as in ``plan`` and budget mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from swap_pass.memory_model import copy_seconds

__all__ = ["SimResult", "simulate"]


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts for one step.

    Attributes:
        stall_s: Seconds compute waits for copies, forward and backward together.
        forward_stall_s: Seconds compute waits for device-to-host copies.
        backward_stall_s: Seconds compute waits for host-to-device copies.
        peak_bytes: Highest saved bytes resident on the device during the step.
        step_s: Predicted step time: compute plus stalls.
    """

    stall_s: float
    forward_stall_s: float
    backward_stall_s: float
    peak_bytes: int
    step_s: float


def _check_inputs(fwd_s, bwd_s, resident_bytes, swap_bytes, d2h_bw, h2d_bw, depth) -> None:
    n = len(fwd_s)
    if not (len(bwd_s) == len(resident_bytes) == len(swap_bytes) == n):
        raise ValueError(
            "swap_pass.simulate: per-group sequences differ in length "
            f"({n}, {len(bwd_s)}, {len(resident_bytes)}, {len(swap_bytes)}). They must be equal."
        )
    if d2h_bw <= 0 or h2d_bw <= 0:
        raise ValueError(
            f"swap_pass.simulate: bandwidths ({d2h_bw}, {h2d_bw}) bytes/s are invalid. "
            "They must be > 0."
        )
    if depth < 0:
        raise ValueError(f"swap_pass.simulate: prefetch_depth={depth} is invalid. It must be >= 0.")


def _forward(fwd_s, resident_bytes, swap_bytes, d2h_bw) -> tuple[float, float, int, int]:
    """Forward pass: returns (end time, stall, peak bytes, bytes resident at the end)."""
    now = stall = 0.0
    mem = peak = 0
    channel_free = 0.0
    waiting: list[tuple[float, int]] = []  # (copy done at, bytes) of groups not yet freed
    for fwd, res, swp in zip(fwd_s, resident_bytes, swap_bytes, strict=True):
        now += fwd
        mem += res + swp
        peak = max(peak, mem)
        for done, nbytes in waiting:  # the previous group is freed at the end of this one
            stall += max(0.0, done - now)
            now = max(now, done)
            mem -= nbytes
        start = max(now, channel_free)
        channel_free = start + copy_seconds(swp, d2h_bw)
        waiting = [(channel_free, swp)] if swp else []
    for done, nbytes in waiting:
        stall += max(0.0, done - now)
        now = max(now, done)
        mem -= nbytes
    return now, stall, peak, mem


def _backward(now, mem, bwd_s, resident_bytes, swap_bytes, h2d_bw,
              depth) -> tuple[float, float, int]:
    """Backward pass in reverse group order: returns (end time, stall, peak bytes)."""
    n = len(bwd_s)
    stall, peak = 0.0, mem
    channel_free = now
    ready: dict[int, float] = {}
    next_issue = n - 1  # highest group whose copy is not issued yet
    for j in range(n - 1, -1, -1):
        while next_issue >= max(j - depth, 0):
            g = next_issue
            if swap_bytes[g]:
                start = max(now, channel_free)
                channel_free = ready[g] = start + copy_seconds(swap_bytes[g], h2d_bw)
                mem += swap_bytes[g]
            next_issue -= 1
        peak = max(peak, mem)
        if j in ready:
            stall += max(0.0, ready[j] - now)
            now = max(now, ready[j])
        now += bwd_s[j]
        mem -= resident_bytes[j] + swap_bytes[j]
    return now, stall, peak


def simulate(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    resident_bytes: Sequence[int],
    swap_bytes: Sequence[int],
    *,
    d2h_bandwidth: float,
    h2d_bandwidth: float,
    prefetch_depth: int = 1,
) -> SimResult:
    """Predict stall and peak memory of one step for a swap choice, group by group.

    Args:
        fwd_s: Forward compute seconds of each group, in forward order.
        bwd_s: Backward compute seconds of each group (indexed like ``fwd_s``).
        resident_bytes: Saved bytes of each group that stay on the device.
        swap_bytes: Saved bytes of each group that go to the host after the group's forward.
        d2h_bandwidth: Device-to-host copy bandwidth, bytes per second.
        h2d_bandwidth: Host-to-device copy bandwidth, bytes per second.
        prefetch_depth: How many groups ahead backward issues a group's host-to-device copy:
            group ``j`` is issued when the backward of group ``j + prefetch_depth`` starts;
            ``0`` issues it when its own backward starts. Default: ``1``.

    Returns:
        A :class:`SimResult`. Copies run one at a time per direction (one stream each), in
        issue order; a group's device memory is allocated when its copy is issued.

    Raises:
        ValueError: sequences of different lengths, a bandwidth <= 0 or a negative depth.
    """
    _check_inputs(fwd_s, bwd_s, resident_bytes, swap_bytes, d2h_bandwidth, h2d_bandwidth,
                  prefetch_depth)
    now, f_stall, f_peak, mem = _forward(fwd_s, resident_bytes, swap_bytes, d2h_bandwidth)
    end, b_stall, b_peak = _backward(now, mem, bwd_s, resident_bytes, swap_bytes,
                                     h2d_bandwidth, prefetch_depth)
    return SimResult(stall_s=f_stall + b_stall, forward_stall_s=f_stall, backward_stall_s=b_stall,
                     peak_bytes=max(f_peak, b_peak), step_s=end)
