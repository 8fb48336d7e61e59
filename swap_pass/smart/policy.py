"""SmartSwap's policy generator: which saved storages leave the device, and when they return.

From one :class:`~swap_pass.smart.profiler.DetailedProfile`:

1. **Logical layers.** The pack sequence is cut into ``num_groups`` equal groups; each group's
   compute time is estimated as (step time - copy time) / groups, split forward/backward.
2. **Memory-reduction list (MRL).** Replaying the profile's storage lifetimes without swap gives
   the resident-bytes curve; the ticks where it passes the budget, and by how much.
3. **Candidate list (CL).** Storages that could leave after their last forward holder let go
   (``released``) and that backward reads later (``unpacked``), at least ``min_swap_bytes``.
4. **Greedy choice.** For each prefetch depth (in logical layers) from 0 to the maximum: while
   the replayed peak is above budget, take the largest candidate that is off the device at the
   peak tick (ties: the earliest released, whose copy has the longest window). Each choice is
   scored with :func:`~swap_pass.smart.simulator.simulate`; the plan kept is within budget,
   then with the least predicted stall, then moves the fewest bytes, then prefetches least far.

The result, :class:`SwapPolicy`, only tags entries; the executor reads the tags.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

from swap_pass.smart.profiler import DetailedProfile, SavedRecord, StorageLife
from swap_pass.smart.simulator import SimResult, simulate

__all__ = ["PolicyEntry", "SwapPolicy", "free_ticks", "gen_policy", "prefetch_ticks", "replay_peak"]


@dataclasses.dataclass(frozen=True)
class PolicyEntry:
    """One saved tensor of the planned sequence (forward order) and what to do with it.

    Attributes:
        index: Position in the planned sequence.
        key: Feature key (op, call site, dtype, shape, model state) used for matching.
        op: Producing autograd node name.
        fqn: Module call site.
        nbytes: Bytes of its storage.
        group: Logical layer it belongs to.
        storage: Storage ordinal in the profiled step (-1: model state or not swappable).
        swap: Whether its storage leaves the device once nothing else holds it.
        cls: Structure key (see :class:`~swap_pass.smart.profiler.SavedRecord`).
    """

    index: int
    key: int
    op: str
    fqn: str
    nbytes: int
    group: int
    storage: int
    swap: bool
    cls: int = 0


@dataclasses.dataclass
class SwapPolicy:
    """A plan for one operator sequence. Inspect it with ``print(policy.summary())``.

    Attributes:
        budget_bytes: Resident saved-activation bytes the plan must stay under.
        entries: One :class:`PolicyEntry` per saved tensor, forward order.
        prefetch: ``{entry index unpacked: [entry indices whose storage to start bringing back]}``.
        prefetch_depth: Groups ahead that backward prefetches.
        num_groups: Logical layers used.
        unswapped_peak: Replayed peak without swapping, bytes.
        predicted_peak: Replayed peak with this plan, bytes.
        predicted: The simulator's prediction for this plan.
        feasible: ``predicted_peak <= budget_bytes``.
        memory_reduction: MRL: ``(first tick, last tick, max bytes above budget)`` runs.
        candidates: Storage ordinals that could be swapped (CL).
        swapped: Storage ordinals chosen.
        keys: Feature keys in forward order (what the lightweight signature is compared to).
        signature: Hash of ``keys``.
        overlap_groups: Logical layers a device-to-host copy may run before the forward waits
            for it (see Note: [Waiting for a copy a logical layer later] in executor.py).
    """

    budget_bytes: int
    entries: list[PolicyEntry]
    prefetch: dict[int, list[int]]
    prefetch_depth: int
    num_groups: int
    unswapped_peak: int
    predicted_peak: int
    predicted: SimResult
    feasible: bool
    memory_reduction: list[tuple[int, int, int]]
    candidates: list[int]
    swapped: list[int]
    keys: list[int]
    signature: int
    overlap_groups: int = 0

    @functools.cached_property
    def class_keys(self) -> list[int]:
        """Structure keys in forward order (shapes left out)."""
        return [e.cls for e in self.entries]

    @property
    def swap_bytes(self) -> int:
        """Bytes of the distinct storages the plan swaps."""
        return sum({e.storage: e.nbytes for e in self.entries if e.swap}.values())

    def summary(self) -> str:
        """A few lines for humans."""
        return (
            f"SwapPolicy: {len(self.entries)} saved tensors in {self.num_groups} groups; swap "
            f"{len(self.swapped)}/{len(self.candidates)} candidate storages; budget "
            f"{self.budget_bytes} B; peak {self.unswapped_peak} B -> {self.predicted_peak} B "
            f"({'within' if self.feasible else 'OVER'} budget); prefetch depth "
            f"{self.prefetch_depth} group(s); copies waited {self.overlap_groups} group(s) later; "
            f"predicted stall {self.predicted.stall_s * 1e3:.3f} ms"
        )

    def __repr__(self) -> str:  # one line; the entries are in ``summary()`` and the attributes
        return (f"SwapPolicy(entries={len(self.entries)}, swapped={len(self.swapped)}/"
                f"{len(self.candidates)} storages, budget_bytes={self.budget_bytes}, "
                f"predicted_peak={self.predicted_peak}, feasible={self.feasible})")


# --- lifetimes and replay -----------------------------------------------------------------------


def prefetch_ticks(profile: DetailedProfile, depth: int, groups: int) -> dict[int, tuple[int, int]]:
    """For each unpacked storage: (tick its copy back starts, record index whose unpack triggers it).

    Backward's unpacks are cut into ``groups`` equal logical layers of ``U / groups`` unpacks;
    a storage first read at unpack rank ``r`` is brought back at rank
    ``max(r - ceil(depth * U / groups), 0)``: ``depth`` layers ahead, ``0`` at its own read.
    """
    unp = profile.unpack_ticks
    if not unp:
        return {}
    ahead = -(-depth * len(unp) // max(1, min(groups, len(unp))))
    rank_of_tick = {tick: r for r, (tick, _) in enumerate(unp)}
    out = {}
    for ordinal, life in enumerate(profile.storages):
        if life.unpacked is None:
            continue
        trigger = max(rank_of_tick[life.unpacked] - ahead, 0)
        out[ordinal] = unp[trigger]
    return out


def free_ticks(profile: DetailedProfile, groups: int, overlap: int) -> dict[int, int]:
    """For each storage that can leave in forward: the tick its device copy is freed when the
    executor waits for its copy ``overlap`` logical layers after the one it started in (at the
    first saved tensor of that layer, or at the start of backward)."""
    n = len(profile.records)
    starts: list[int] = []
    for i, rec in enumerate(profile.records):  # first pack tick of each group
        if _group_of_record(i, n, groups) == len(starts):
            starts.append(rec.tick)
    last = profile.backward_tick if profile.backward_tick is not None else profile.end_tick
    out = {}
    for ordinal, life in enumerate(profile.storages):
        if life.released is None:
            continue
        due = bisect.bisect_right(starts, life.released) - 1 + overlap
        free = starts[due] if due < len(starts) else last
        out[ordinal] = max(min(free, last), life.released)
    return out


def _intervals(life: StorageLife, swapped: bool, back_in: int | None, end: int,
               free: int | None) -> list[tuple[int, int]]:
    drop = life.dropped if life.dropped is not None else end + 1
    if not swapped:
        return [(life.packed, drop)]
    return [(life.packed, free if free is not None else life.released), (back_in, drop)]


def replay_peak(profile: DetailedProfile, swapped: set[int], depth: int, groups: int,
                overlap: int = 0) -> tuple[int, int]:
    """Resident activation bytes over the profiled step for a swap choice: (peak, tick of peak).

    ``overlap``: logical layers each device-to-host copy runs before its storage is freed
    (:func:`free_ticks`); ``0`` frees at release.
    """
    back = prefetch_ticks(profile, depth, groups)
    free = free_ticks(profile, groups, overlap) if overlap else {}
    events: list[tuple[int, int]] = []
    for ordinal, life in enumerate(profile.storages):
        back_in = back[ordinal][0] if ordinal in back else None
        for start, stop in _intervals(life, ordinal in swapped, back_in, profile.end_tick,
                                      free.get(ordinal)):
            events.append((start, life.nbytes))
            events.append((stop, -life.nbytes))
    events.sort(key=lambda e: (e[0], e[1]))
    mem = peak = 0
    peak_tick = 0
    for tick, delta in events:
        mem += delta
        if mem > peak:
            peak, peak_tick = mem, tick
    return peak, peak_tick


def memory_reduction_list(profile: DetailedProfile, budget: int) -> list[tuple[int, int, int]]:
    """Runs of ticks where the unswapped resident bytes pass ``budget``: (first, last, max excess)."""
    events = []
    for life in profile.storages:
        for start, stop in _intervals(life, False, None, profile.end_tick, None):
            events += [(start, life.nbytes), (stop, -life.nbytes)]
    events.sort()
    runs: list[tuple[int, int, int]] = []
    mem, open_at, worst = 0, None, 0
    for tick, delta in events:
        mem += delta
        if mem > budget and open_at is None:
            open_at, worst = tick, 0
        if open_at is not None:
            worst = max(worst, mem - budget)
            if mem <= budget:
                runs.append((open_at, tick, worst))
                open_at = None
    return runs


def candidate_list(profile: DetailedProfile, min_swap_bytes: int) -> list[int]:
    """Storages that can leave after their last forward holder and return before backward reads them."""
    bwd = profile.backward_tick
    return [
        i for i, s in enumerate(profile.storages)
        if s.released is not None and s.unpacked is not None and bwd is not None
        and s.released < bwd and s.nbytes >= max(min_swap_bytes, 1)
    ]


# --- greedy choice --------------------------------------------------------------------------------


def _greedy(profile: DetailedProfile, budget: int, cands: list[int], depth: int, groups: int,
            overlap: int = 0) -> set[int]:
    """Cover the replayed peak until it fits: at the peak tick, take the largest candidates that
    are off the device there until their bytes cover the excess, then replay again."""
    back = prefetch_ticks(profile, depth, groups)
    free = free_ticks(profile, groups, overlap)
    chosen: set[int] = set()
    while True:
        peak, tick = replay_peak(profile, chosen, depth, groups, overlap)
        if peak <= budget:
            return chosen
        covering = [c for c in cands if c not in chosen and free[c] <= tick < back[c][0]]
        if not covering:
            return chosen
        covering.sort(key=lambda c: (-profile.storages[c].nbytes, profile.storages[c].released))
        excess = peak - budget
        for c in covering:
            chosen.add(c)
            excess -= profile.storages[c].nbytes
            if excess <= 0:
                break


def _group_of_record(index: int, n: int, groups: int) -> int:
    return index * groups // max(n, 1)


def _group_bytes(profile: DetailedProfile, chosen: set[int], groups: int) -> tuple[list[int], list[int]]:
    resident, swap = [0] * groups, [0] * groups
    n = len(profile.records)
    for ordinal, life in enumerate(profile.storages):
        g = _group_of_record(life.entries[0], n, groups)
        (swap if ordinal in chosen else resident)[g] += life.nbytes
    return resident, swap


def _simulate(profile, chosen, groups, depth, fwd_fraction, d2h_bw, h2d_bw) -> SimResult:
    compute = profile.compute_s()
    fwd = [compute * fwd_fraction / groups] * groups
    bwd = [compute * (1 - fwd_fraction) / groups] * groups
    resident, swap = _group_bytes(profile, chosen, groups)
    return simulate(fwd, bwd, resident, swap, d2h_bandwidth=d2h_bw, h2d_bandwidth=h2d_bw,
                    prefetch_depth=depth)


def _choose(profile, budget, cands, groups, max_depth, max_overlap, sim_args):
    """Greedy choice at each copy overlap and prefetch depth; keep the best: within budget (else
    the lowest peak), then the longest overlap, least stall, fewest bytes moved, shallowest.
    Returns (chosen storages, depth, overlap, replayed peak, prediction)."""
    best, best_rank = None, None
    for overlap in range(max_overlap, -1, -1):
        for depth in range(0, max_depth + 1):
            chosen = _greedy(profile, budget, cands, depth, groups, overlap)
            peak, _ = replay_peak(profile, chosen, depth, groups, overlap)
            sim = _simulate(profile, chosen, groups, depth, *sim_args)
            moved = sum(profile.storages[c].nbytes for c in chosen)
            rank = (peak > budget, peak if peak > budget else 0, -overlap, round(sim.stall_s, 9),
                    moved, depth)
            if best_rank is None or rank < best_rank:
                best, best_rank = (chosen, depth, overlap, peak, sim), rank
    return best


def gen_policy(
    profile: DetailedProfile,
    budget_bytes: int,
    *,
    num_groups: int = 8,
    min_swap_bytes: int = 0,
    max_prefetch_depth: int = 4,
    fwd_fraction: float = 1 / 3,
    d2h_bandwidth: float = 10e9,
    h2d_bandwidth: float = 10e9,
    max_overlap_groups: int = 0,
) -> SwapPolicy:
    """Build a :class:`SwapPolicy` for the profiled sequence under ``budget_bytes``.

    Args:
        profile: One detailed profile.
        budget_bytes: Resident saved-activation bytes allowed at any time.
        num_groups: Logical layers (equal groups of the pack sequence). Default: ``8``.
        min_swap_bytes: Storages below this stay on the device. Default: ``0``.
        max_prefetch_depth: Deepest prefetch tried, in groups. Default: ``4``.
        fwd_fraction: Share of compute in forward. Default: ``1/3``.
        d2h_bandwidth: Bytes/s device to host. Default: ``10e9``.
        h2d_bandwidth: Bytes/s host to device. Default: ``10e9``.
        max_overlap_groups: Most logical layers a device-to-host copy may run before the
            forward waits for it; the longest that fits the budget is taken. Default: ``0``.
    """
    groups = max(1, min(num_groups, len(profile.records) or 1))
    cands = candidate_list(profile, min_swap_bytes)
    sim_args = (fwd_fraction, d2h_bandwidth, h2d_bandwidth)
    chosen, depth, overlap, peak, sim = _choose(profile, budget_bytes, cands, groups,
                                                max_prefetch_depth, max_overlap_groups, sim_args)
    entries = _entries(profile.records, profile.storages, chosen, groups)
    return SwapPolicy(
        budget_bytes=budget_bytes, entries=entries,
        prefetch=_prefetch_plan(profile, chosen, depth, groups), prefetch_depth=depth,
        num_groups=groups, unswapped_peak=replay_peak(profile, set(), 0, groups)[0],
        predicted_peak=peak, predicted=sim, feasible=peak <= budget_bytes,
        memory_reduction=memory_reduction_list(profile, budget_bytes), candidates=cands,
        swapped=sorted(chosen), keys=profile.keys, signature=hash(tuple(profile.keys)),
        overlap_groups=overlap,
    )


def _entries(records: list[SavedRecord], storages: list[StorageLife], chosen: set[int],
             groups: int) -> list[PolicyEntry]:
    n = len(records)
    return [
        PolicyEntry(index=r.index, key=r.key, op=r.op, fqn=r.fqn,
                    nbytes=storages[r.storage].nbytes if r.storage >= 0 else r.nbytes,
                    group=_group_of_record(r.index, n, groups), storage=r.storage,
                    swap=r.storage in chosen, cls=r.cls)
        for r in records
    ]


def _prefetch_plan(profile: DetailedProfile, chosen: set[int], depth: int, groups: int) -> dict[int, list[int]]:
    plan: dict[int, list[int]] = {}
    for ordinal, (tick, trigger) in prefetch_ticks(profile, depth, groups).items():
        life = profile.storages[ordinal]
        if ordinal in chosen and tick < life.unpacked:
            plan.setdefault(trigger, []).extend(life.entries)
    return plan
