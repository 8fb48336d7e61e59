"""The largest size that fits: exponential steps from a first guess, then a binary search.

One search for both the measured capacity (each probe a training step under the cap) and the
planned one (each probe a formula), so that the two answer the same question the same way.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["largest_fitting"]


def _step_up(fits: Callable[[int], bool], lo: int, limit: int) -> tuple[int, int | None]:
    """From a fitting ``lo``, steps of 1, 2, 4... up to the first size that does not fit."""
    step = 1
    while lo < limit:
        n = min(lo + step, limit)
        if not fits(n):
            return lo, n
        lo, step = n, step * 2
    return lo, None


def _step_down(fits: Callable[[int], bool], hi: int) -> tuple[int, int]:
    """From a size ``hi`` that does not fit, steps of 1, 2, 4... down to one that fits (0: none)."""
    step = 1
    while hi > 1:
        n = max(hi - step, 1)
        if fits(n):
            return n, hi
        hi, step = n, step * 2
    return 0, 1


def largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """Largest ``n`` in ``[1, limit]`` with ``fits(n)``; 0 when even 1 does not fit.

    ``fits`` must be monotone (true up to some size, false beyond). The first probe is ``start``
    (clamped to the range), so a good guess costs two probes.

    Raises:
        ValueError: ``limit < 1``.
    """
    if limit < 1:
        raise ValueError(f"swap_pass.tools.capacity: search limit={limit} is invalid. It must be "
                         ">= 1.")
    start = min(max(start, 1), limit)
    if fits(start):
        lo, hi = _step_up(fits, start, limit)
        if hi is None:
            return lo
    else:
        lo, hi = _step_down(fits, start)
        if lo == 0:
            return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
