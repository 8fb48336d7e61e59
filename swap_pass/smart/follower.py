"""Following a plan in a stable step: which saved tensor is which plan entry, what moves, when.

A :class:`Follower` runs one :class:`~swap_pass.smart.policy.SwapPolicy` over one micro-batch:
it matches each live feature key to a plan entry (:class:`OnlineMatcher`), switches to a cached
plan when the one in force misses (Note: [Choosing a cached plan mid-step]) and gives up after
``miss_limit`` misses in a row (Note: [Falling back mid-step] in executor.py). It only decides;
the copies are the executor's.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Iterator

from swap_pass.smart.policy import SwapPolicy

__all__ = ["Follower", "OnlineMatcher"]


# --- Online alignment of live feature keys to a planned sequence (SmartSwap's fuzzy matching) -----

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


# --- following a plan -----------------------------------------------------------------------------


class Follower:
    """One micro-batch's run of a plan.

    Args:
        policy: The plan the micro-batch starts with.
        window: :class:`OnlineMatcher` window.
        miss_limit: Consecutive unmatched activations after which the micro-batch gives up the
            plan (:meth:`lost`).
        plans: Returns the cached plans it may switch to, most recently used first.

    Attributes:
        policy: The plan in force (another cached one after a switch).
        by_structure: The plan in force was made for another length of the same structure.
        group: Logical layer of the plan the forward is in.
        misses: Saved tensors the plans did not match.
        fell_back: The micro-batch gave up the plan (:meth:`fall_back`); it runs conservative.
        kept: Tracked slots the plan keeps on the device (moved if it falls back).
        by_index: Plan position -> its tracked slot (for the prefetch).
    """

    def __init__(self, policy: SwapPolicy, *, window: int, miss_limit: int,
                 plans: Callable[[], Iterable[SwapPolicy]]) -> None:
        self.policy = policy
        self.matcher = OnlineMatcher(policy.keys, window)
        self.by_structure = False
        self.group = 0
        self.misses = 0
        self.fell_back = False
        self.kept: list[weakref.ref] = []
        self.by_index: dict[int, weakref.ref] = {}
        self._streak = 0  # consecutive activations unmatched
        self._window, self._miss_limit, self._plans = window, miss_limit, plans

    def entry_swap(self, pos: int) -> bool:
        """Whether the plan moves the storage of its entry ``pos``."""
        return self.policy.entries[pos].swap

    def match(self, unit, key: int, nbytes: int, is_state: bool) -> int | None:
        """The plan position of the tensor ``unit`` (a :class:`~swap_pass.smart.saved.MicroBatch`)
        just saved, or None; model state neither resets nor extends the miss streak. A missed
        activation may switch plans: Note: [Choosing a cached plan mid-step]."""
        j = self.matcher.match(unit.classes[-1] if self.by_structure else key)
        if j is None and not is_state:
            j = self._switch_plan(unit, key, nbytes)
        if not is_state:
            self._streak = 0 if j is not None else self._streak + 1
        if j is None:
            self.misses += 1
        else:
            self.group = self.policy.entries[j].group
        return j

    def lost(self) -> bool:
        """True after ``miss_limit`` activations in a row matched nothing."""
        return self._streak >= self._miss_limit

    def fall_back(self, floor: int) -> list[weakref.ref]:
        """Give up the plan: what it kept so far, of ``floor`` bytes or more, becomes swappable.

        Returns:
            The slots it kept, for the executor's pending list (those below ``floor`` stay).
        """
        self.fell_back = True
        for ref in self.kept:  # tracked for the profile too: only those worth moving go
            slot = ref()
            if slot is not None and slot.aliases[0].untyped_storage().nbytes() >= floor:
                slot.swap = True
        kept, self.kept = self.kept, []
        return kept

    def prefetch_targets(self, index: int) -> Iterator[weakref.ref | None]:
        """The slots whose copy back the plan starts at the unpack of its entry ``index``."""
        return (self.by_index.get(j) for j in self.policy.prefetch.get(index, ()))

    # --- choosing a cached plan mid-step --------------------------------------------------------

    def _switch_plan(self, unit, key: int, nbytes: int) -> int | None:
        """On a miss, run the cached plan that fits this micro-batch so far; its ``key`` position.

        Note: [Choosing a cached plan mid-step]
        A step's signature is known only at its end, but its first saved tensor whose shape
        changed (the embedding's input, for a new sequence length) already misses the plan in
        force. Every cached plan is then tried on the keys saved so far: one matching them all
        (an earlier shape) is taken at once; else the smallest plan of the same *structure* (keys
        without shapes) made for a larger shape, which keeps at most what it kept there, so
        under a byte budget the peak can only be lower. The storages tracked so far are
        re-tagged by the new plan, as if the step had started with it.
        """
        best = None
        for plan in self._plans():
            found = self._try_plan(unit, plan, key, nbytes, by_structure=False)
            found = found or self._try_plan(unit, plan, key, nbytes, by_structure=True)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        if best is None or best[0][1] > self.misses:  # the plan in force missed this key too
            return None
        _, plan, matcher, positions, by_structure = best
        self._retag(unit, plan, matcher, positions, by_structure)
        return positions[-1]

    def _try_plan(self, unit, plan: SwapPolicy, key: int, nbytes: int, *, by_structure: bool):
        if plan is self.policy and not by_structure:
            return None
        matcher = OnlineMatcher(plan.class_keys if by_structure else plan.keys, self._window)
        live = unit.classes if by_structure else unit.report.keys
        if live[-1] not in matcher:
            return None
        positions = [matcher.match(k) for k in live]
        j = positions[-1]
        if j is None:
            return None
        size = plan.entries[j].nbytes
        if by_structure and size < nbytes:  # made for a shorter sequence: could pass the budget
            return None
        rank = (by_structure, positions.count(None), size if by_structure else 0)
        return rank, plan, matcher, positions, by_structure

    def _retag(self, unit, plan: SwapPolicy, matcher: OnlineMatcher, positions: list,
               by_structure: bool) -> None:
        self.policy, self.matcher, self.by_structure = plan, matcher, by_structure
        unit.report.switched = True
        self.by_index = {}
        slots = {}
        # positions also covers the tensor being saved now (its handle is not in unit.handles)
        for ref, pos in zip(unit.handles, positions, strict=False):
            handle = ref() if ref is not None else None
            if handle is None:
                continue
            handle.index = -1 if pos is None else pos
            if handle.slot is not None and handle.slot.group is None:
                slot = handle.slot
                swap = (slots.get(id(slot), (slot, False))[1]
                        or (pos is not None and plan.entries[pos].swap))
                slots[id(slot)] = (slot, swap)
            if handle.slot is not None and pos is not None:
                self.by_index[pos] = weakref.ref(handle.slot)
        self.kept = []
        for slot, swap in slots.values():
            slot.swap = swap
            (unit.pending if swap else self.kept).append(weakref.ref(slot))
