"""Online alignment of live feature keys to a planned sequence (SmartSwap's fuzzy matching)."""

from __future__ import annotations

import bisect

__all__ = ["OnlineMatcher"]


class OnlineMatcher:
    """Aligns live feature keys to a planned sequence as they arrive, tolerating edits.

    Each key is looked up at or after the cursor, at most ``window`` positions ahead: a removed
    op skips positions, an inserted op's key finds nothing and stays unmatched. ``streak``
    counts consecutive misses.

    Args:
        keys: The planned key sequence.
        window: How far ahead of the cursor a key may match.
    """

    def __init__(self, keys: list[int], window: int) -> None:
        self.window = window
        self.cursor = 0
        self.streak = 0
        self._positions: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            self._positions.setdefault(k, []).append(i)

    def __contains__(self, key: int) -> bool:
        return key in self._positions

    def match(self, key: int) -> int | None:
        """Position of ``key`` in the plan, or None (and the miss streak grows)."""
        pos = self._positions.get(key)
        if pos:
            i = bisect.bisect_left(pos, self.cursor)
            if i < len(pos) and pos[i] < self.cursor + self.window:
                self.cursor = pos[i] + 1
                self.streak = 0
                return pos[i]
        self.streak += 1
        return None
