"""SmartSwap's policy generator: which saved storages leave the device, and when they return.

From one :class:`~swap_pass.smart.profiler.DetailedProfile`:

1. **Logical layers.** The pack sequence is cut into ``num_groups`` equal groups; each group's
   compute time is estimated as (step time - copy time) / groups, split forward/backward.
2. **Memory-reduction list (MRL).** Replaying the profile's storage lifetimes without swap gives
   the resident-bytes curve; the ticks where it passes the budget, and by how much.
3. **Candidate list (CL).** Storages that could leave after their last forward holder let go
   (``released``) and that backward reads later (``unpacked``), at least ``min_swap_bytes``.
4. **Greedy choice.** For each copy overlap and prefetch depth (in logical layers): while the
   replayed peak is above budget, take the largest candidate off the device at the peak tick
   (ties: the earliest released, whose copy has the longest window). Choices are scored with
   :func:`simulate`; :func:`_choose` says which is kept.

The result, :class:`SwapPolicy`, only tags entries; the executor reads the tags.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
from collections.abc import Sequence

from swap_pass.cost.model import FORWARD_SHARE, copy_seconds
from swap_pass.smart.profiler import DetailedProfile, SavedRecord, StorageLife, sequence_distance

__all__ = ["PlanCache", "PolicyEntry", "SimResult", "SwapPolicy", "explain_peak", "free_ticks",
           "gen_policy", "prefetch_ticks", "replay_peak", "simulate"]


# --- SmartSwap's plan cache: one plan per operator sequence seen, least recently used out first ---


class PlanCache:
    """Plans by the lightweight signature of their sequence, at most ``size`` of them, least
    recently used evicted first; :meth:`find` also serves the nearest sequence in ``threshold``.

    Args:
        size: Most plans kept (``>= 1``).
        threshold: Largest key-sequence distance (0..1) at which a plan serves another sequence.

    Attributes:
        hits: Micro-batches that switched to a cached plan of an earlier shape and ran it.
        misses: Micro-batches whose sequence had no plan within the threshold (a plan was made
            from their profile).
        evictions: Plans dropped to keep the bound.
        derived: Micro-batches that ran a plan made for a larger shape of the same structure.
    """

    def __init__(self, size: int, threshold: float) -> None:
        self.size = size
        self.threshold = threshold
        self._plans: collections.OrderedDict[int, SwapPolicy] = collections.OrderedDict()
        self._aliases: dict[int, tuple[int, float]] = {}  # signature -> (plan signature, distance)
        self.hits = self.misses = self.evictions = self.derived = 0

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> list[SwapPolicy]:
        """The cached plans, most recently used first: a follower's candidates when the plan in
        force misses (Note: [Choosing a cached plan mid-step] in follower.py)."""
        return list(reversed(self._plans.values()))

    def find(self, signature: int, keys: list[int]) -> tuple[SwapPolicy, float] | None:
        """The plan for ``keys`` and its distance, or None: exact signature, else the nearest
        within the threshold (remembered as an alias); it becomes the most recently used."""
        found = self._lookup(signature, keys)
        if found is not None:
            self._plans.move_to_end(found[0].signature)
        return found

    def _lookup(self, signature: int, keys: list[int]) -> tuple[SwapPolicy, float] | None:
        if signature in self._plans:
            return self._plans[signature], 0.0
        alias = self._aliases.get(signature)
        if alias is not None and alias[0] in self._plans:
            return self._plans[alias[0]], alias[1]
        near = [(sequence_distance(keys, p.keys), p) for p in self._plans.values()]
        near = [(d, p) for d, p in near if d <= self.threshold]
        if not near:
            return None
        distance, plan = min(near, key=lambda dp: dp[0])
        self._aliases[signature] = (plan.signature, distance)
        return plan, distance

    def put(self, plan: SwapPolicy) -> None:
        """Add ``plan`` as most recently used, evicting the least recently used past ``size``."""
        self._plans[plan.signature] = plan
        self._plans.move_to_end(plan.signature)
        while len(self._plans) > self.size:
            gone, _ = self._plans.popitem(last=False)
            self._aliases = {s: a for s, a in self._aliases.items() if a[0] != gone}
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        """``{"plans", "hits", "misses", "evictions", "derived"}``."""
        return {"plans": len(self), "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "derived": self.derived}


# --- the simulator: timing and memory of one step, per logical layer ------------------------------
# Pattern it models (``G`` groups, forward then backward in reverse)::
#     compute:  F0 F1 .. F(G-1) | B(G-1) .. B1 B0
#     d2h:         o0 o1 ..           (group i leaves after F(i); freed once its copy is done,
#                                      the compute stream waits for it at the end of F(i+1))
#     h2d:                      i(j-d) ... (group j's copy is issued when B(j+d) starts, FIFO;
#                                      B(j) waits for it)
#
# Plain numbers, no tensors: ``swap-pass plan`` and the policy ask it the stall and peak of a
# choice without running the model. A copy takes :func:`swap_pass.cost.model.copy_seconds`.


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


# --- the policy: candidates, the greedy choice, the plan ------------------------------------------


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
        unreachable: For a plan over budget, why: where its peak lies (tick, forward or
            backward) and what is resident there, by cause; ``""`` for a feasible plan.
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
    unreachable: str = ""

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
            + (f"; over budget because {self.unreachable}" if self.unreachable else "")
        )

    def __repr__(self) -> str:  # one line; the entries are in ``summary()`` and the attributes
        return (f"SwapPolicy(entries={len(self.entries)}, swapped={len(self.swapped)}/"
                f"{len(self.candidates)} storages, budget_bytes={self.budget_bytes}, "
                f"predicted_peak={self.predicted_peak}, feasible={self.feasible})")


# --- lifetimes and replay -----------------------------------------------------------------------


def prefetch_ticks(profile: DetailedProfile, depth: int, groups: int) -> dict[int, tuple[int, int]]:
    """For each unpacked storage: (tick its copy back starts, record index whose unpack
    triggers it). With ``U`` unpacks, one first read at unpack rank ``r`` comes back at rank
    ``max(r - ceil(depth * U / groups), 0)``: ``depth`` logical layers ahead."""
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
    ``overlap``: as in :func:`free_ticks` (``0`` frees at release)."""
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
    """Runs of ticks where unswapped resident bytes pass ``budget``: (first, last, max excess)."""
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
    """Storages that can leave before backward (after their last forward holder) and it reads."""
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
        if not covering:  # Note: [Budgets the peak cannot reach]
            return _lower_elsewhere(profile, budget, cands, chosen, free, back, depth, groups,
                                    overlap)
        covering.sort(key=lambda c: (-profile.storages[c].nbytes, profile.storages[c].released))
        excess = peak - budget
        for c in covering:
            chosen.add(c)
            excess -= profile.storages[c].nbytes
            if excess <= 0:
                break


def _curve(profile: DetailedProfile, chosen: set[int], depth: int, groups: int,
           overlap: int, breaks=()) -> tuple[list[int], list[int]]:
    """Resident bytes from each tick with an event (or in ``breaks``) to the next (at its end:
    the most during that tick, as frees come first), as (ticks, bytes)."""
    back = prefetch_ticks(profile, depth, groups)
    free = free_ticks(profile, groups, overlap) if overlap else {}
    delta: dict[int, int] = dict.fromkeys(breaks, 0)
    for ordinal, life in enumerate(profile.storages):
        back_in = back[ordinal][0] if ordinal in back else None
        for start, stop in _intervals(life, ordinal in chosen, back_in, profile.end_tick,
                                      free.get(ordinal)):
            delta[start] = delta.get(start, 0) + life.nbytes
            delta[stop] = delta.get(stop, 0) - life.nbytes
    ticks = sorted(delta)
    mem, out = 0, []
    for tick in ticks:
        mem += delta[tick]
        out.append(mem)
    return ticks, out


def _excess_area(profile, chosen, depth, groups, overlap, budget) -> int:
    """Bytes x ticks the resident curve of a choice spends above ``budget``."""
    ticks, mem = _curve(profile, chosen, depth, groups, overlap)
    # consecutive ticks: the last tick opens no interval
    return sum(max(m - budget, 0) * (t1 - t0)
               for t0, t1, m in zip(ticks, ticks[1:], mem, strict=False))


def _lower_elsewhere(profile, budget, cands, chosen, free, back, depth, groups,
                     overlap) -> set[int]:
    """The peak cannot come down: lower the rest of the step as far as it goes.

    Note: [Budgets the peak cannot reach]
    Where no candidate can be off the device at the peak (all still used by the forward, or
    back for backward), stopping would leave every other tick as it was: with
    ``memory_budget=0`` on ``(x + 1) * (x + 1)`` stable steps moved nothing while conservative
    steps freed both operands after the product. So the choice goes on, largest first, taking
    each candidate whose off-device window holds a tick still over budget. The plan stays
    infeasible; ``SwapPolicy.unreachable`` says why.
    """
    rest = sorted((c for c in cands if c not in chosen),
                  key=lambda c: (-profile.storages[c].nbytes, profile.storages[c].released))
    breaks = {free[c] for c in rest} | {back[c][0] for c in rest}  # window edges split the curve
    ticks, mem = _curve(profile, chosen, depth, groups, overlap, breaks)
    chosen = set(chosen)
    for c in rest:
        lo, hi = bisect.bisect_left(ticks, free[c]), bisect.bisect_left(ticks, back[c][0])
        if lo < hi and max(mem[lo:hi]) > budget:
            chosen.add(c)
            nbytes = profile.storages[c].nbytes
            mem[lo:hi] = [m - nbytes for m in mem[lo:hi]]
    return chosen


def explain_peak(profile: DetailedProfile, chosen: set[int], depth: int, groups: int, overlap: int,
                 min_swap_bytes: int) -> tuple[int, str]:
    """Why a choice's replayed peak is where it is: (its tick, bytes there by cause, in words)."""
    peak, tick = replay_peak(profile, chosen, depth, groups, overlap)
    back = prefetch_ticks(profile, depth, groups)
    free = free_ticks(profile, groups, overlap)
    causes: dict[str, int] = {}
    for ordinal, life in enumerate(profile.storages):
        back_in = back[ordinal][0] if ordinal in back else None
        spans = _intervals(life, ordinal in chosen, back_in, profile.end_tick, free.get(ordinal))
        if any(a <= tick < b for a, b in spans):
            cause = _cause(profile, life, ordinal, tick, back_in, free, min_swap_bytes)
            causes[cause] = causes.get(cause, 0) + life.nbytes
    in_backward = profile.backward_tick is not None and tick >= profile.backward_tick
    phase = "backward" if in_backward else "forward"
    parts = ", ".join(f"{n} B {cause}"
                      for cause, n in sorted(causes.items(), key=lambda kv: -kv[1]))
    return tick, f"the peak of {peak} B lies at tick {tick} ({phase}), where {parts}"


def _cause(profile, life: StorageLife, ordinal: int, tick: int, back_in, free,
           min_swap_bytes) -> str:
    if life.nbytes < max(min_swap_bytes, 1):
        return "are below min_swap_bytes"
    if life.released is None or life.released > tick:
        return "are still in use outside autograd (the forward's variables and ops hold them)"
    if back_in is not None and back_in <= tick:
        return "are back on the device for backward"
    if life.unpacked is None:
        return "are never read by backward"
    if ordinal in free and free[ordinal] > tick:
        return "are still being copied to the host"
    return "stay by the plan"


def _group_of_record(index: int, n: int, groups: int) -> int:
    return index * groups // max(n, 1)


def _group_bytes(profile: DetailedProfile, chosen: set[int],
                 groups: int) -> tuple[list[int], list[int]]:
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
    the lowest peak, then the least bytes x ticks over budget), then the longest overlap, least
    stall, fewest bytes moved, shallowest. Returns (chosen, depth, overlap, peak, prediction)."""
    best, best_rank = None, None
    for overlap in range(max_overlap, -1, -1):
        for depth in range(0, max_depth + 1):
            chosen = _greedy(profile, budget, cands, depth, groups, overlap)
            peak, _ = replay_peak(profile, chosen, depth, groups, overlap)
            sim = _simulate(profile, chosen, groups, depth, *sim_args)
            moved = sum(profile.storages[c].nbytes for c in chosen)
            over = (_excess_area(profile, chosen, depth, groups, overlap, budget)
                    if peak > budget else 0)
            rank = (peak > budget, peak if peak > budget else 0, over, -overlap,
                    round(sim.stall_s, 9), moved, depth)
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
    fwd_fraction: float = FORWARD_SHARE,
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
        fwd_fraction: Share of compute in forward. Default: ``1/3``
            (:data:`~swap_pass.cost.model.FORWARD_SHARE`: backward is twice the forward).
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
    unreachable = ""
    if peak > budget_bytes:
        unreachable = explain_peak(profile, chosen, depth, groups, overlap, min_swap_bytes)[1]
    return SwapPolicy(
        budget_bytes=budget_bytes, entries=entries,
        prefetch=_prefetch_plan(profile, chosen, depth, groups), prefetch_depth=depth,
        num_groups=groups, unswapped_peak=replay_peak(profile, set(), 0, groups)[0],
        predicted_peak=peak, predicted=sim, feasible=peak <= budget_bytes,
        memory_reduction=memory_reduction_list(profile, budget_bytes), candidates=cands,
        swapped=sorted(chosen), keys=profile.keys, signature=hash(tuple(profile.keys)),
        overlap_groups=overlap, unreachable=unreachable,
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


def _prefetch_plan(profile: DetailedProfile, chosen: set[int], depth: int,
                   groups: int) -> dict[int, list[int]]:
    plan: dict[int, list[int]] = {}
    for ordinal, (tick, trigger) in prefetch_ticks(profile, depth, groups).items():
        life = profile.storages[ordinal]
        if ordinal in chosen and tick < life.unpacked:
            plan.setdefault(trigger, []).extend(life.entries)
    return plan
