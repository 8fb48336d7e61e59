"""SmartSwap's executor: ``saved_tensors_hooks`` that carry out a policy through the shared runtime.

Per saved tensor (pack)::

    poll: any storage that only our aliases still hold -> SwapTensors(aliases).swap_to_host()
          (+ wait_d2h(), storage freed: in planned steps ``policy.overlap_groups`` logical
          layers later, see Note: [Waiting for a copy a logical layer later]; else at once on
          CPU, at the next poll on an accelerator)
    key = (op, module call site, dtype, shape, model state)
    planned step: match key to the policy (window search from a cursor) -> swap or keep (tracked,
          so that a fallback can still move it; see Note: [Falling back mid-step]); on a miss,
          maybe switch to a cached plan (Note: [Choosing a cached plan mid-step])
    a forward after a backward: a new micro-batch, the plan restarts (gradient accumulation)
    conservative step (warmup, gen_policy, or too many misses): every eligible activation
    -> handle(alias over the same storage) or the tensor itself (unmatched, state, not swappable)

Per unpack: restore the storage from any state (``group.restore()``), assert it is on the device,
then start the copies back of the storages the plan prefetches at this point. Every moved
storage is restored before it is read, so a wrong match can cost memory or a stall, never data.

# Note: [When a saved tensor may leave]
# Eager mode gives no op ids, so "after its last forward use" is read from reference counts:
# the pack hook keeps an *alias* (a new tensor over the same storage), not the tensor itself,
# and a storage whose use count equals the number of our aliases is held by nobody else (no
# Python variable, no view, no op argument still in flight, no module buffer) and so cannot be
# read again before backward unpacks it. Checking at every pack and module exit is cheap.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import weakref

import torch

from swap_pass.config import SwapConfig
from swap_pass.runtime.device import is_async_device
from swap_pass.runtime.ownership import outside_holders
from swap_pass.runtime.swap_tensors import D2H, DEVICE, H2D, HOST, SwapTensors, is_valid_for_swap
from swap_pass.runtime.skips import SkipReason, record_skip
from swap_pass.smart.policy import SwapPolicy
from swap_pass.smart.profiler import (
    DetailedProfile,
    SavedRecord,
    StorageLife,
    feature_key,
    now,
    op_name,
    state_key,
)
from swap_pass.smart.saved_local import is_dtensor, local_of, storage_nbytes

__all__ = ["ExecMode", "MicroBatchReport", "OnlineMatcher", "SmartExecutor", "StepReport",
           "measure_copy_bandwidth"]



class ExecMode(str, enum.Enum):
    """How the executor decides per saved tensor."""

    CONSERVATIVE = "conservative"  # swap every eligible activation (warmup)
    DETAILED = "detailed"  # conservative + record a DetailedProfile (gen_policy)
    PLANNED = "planned"  # follow a SwapPolicy (stable)


@dataclasses.dataclass
class StepReport:
    """What one step did.

    Attributes:
        keys: Feature keys of the first micro-batch in forward order (the lightweight profile).
        signature: Hash of ``keys``.
        mode: Executor mode the step began in.
        fell_back: A planned micro-batch switched to conservative after too many unmatched tensors.
        matched: Saved tensors matched to policy entries.
        unmatched: Saved tensors not matched (kept on the device).
        swapped_storages: Storages moved to the host.
        swapped_bytes: Their bytes.
        sync_restores: Unpacks that found their data still off the device (a stall).
        d2h_waits: Per device-to-host copy of a planned micro-batch: (logical layer it started
            in, logical layer whose start waited for it; the plan's group count for backward).
        profile: The detailed profile of the first micro-batch (``DETAILED`` steps, and
            ``PLANNED`` steps that record), else None.
        micro_batches: Forward + backward passes in the step (gradient accumulation).
        units: Per micro-batch: :class:`MicroBatchReport`.
    """

    keys: list[int]
    signature: int
    mode: ExecMode
    fell_back: bool = False
    matched: int = 0
    unmatched: int = 0
    swapped_storages: int = 0
    swapped_bytes: int = 0
    sync_restores: int = 0
    profile: DetailedProfile | None = None
    d2h_waits: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    micro_batches: int = 0
    units: list[MicroBatchReport] = dataclasses.field(default_factory=list)

    def __repr__(self) -> str:  # one line; ``keys`` and ``profile`` are in the attributes
        return (f"StepReport(mode={self.mode.value!r}, saved={len(self.keys)}, matched={self.matched}, "
                f"unmatched={self.unmatched}, swapped_storages={self.swapped_storages}, "
                f"swapped_bytes={self.swapped_bytes}, sync_restores={self.sync_restores}, "
                f"fell_back={self.fell_back}, micro_batches={self.micro_batches})")


@dataclasses.dataclass
class MicroBatchReport:
    """What one forward + backward of a step did.

    Attributes:
        keys: Feature keys in forward order.
        profile: Its detailed profile, when the step recorded one.
        plan: The plan it ran to its end (None: conservative, or fell back).
        switched: It left the step's first plan for another cached plan (see
            Note: [Choosing a cached plan mid-step]).
        by_structure: The plan it ran was made for another length of the same structure.
        fell_back: It turned conservative after ``miss_limit`` unmatched tensors.
    """

    keys: list[int]
    profile: DetailedProfile | None = None
    plan: SwapPolicy | None = None
    switched: bool = False
    by_structure: bool = False
    fell_back: bool = False

    def __repr__(self) -> str:  # one line; ``keys`` and ``profile`` are in the attributes
        return (f"MicroBatchReport(saved={len(self.keys)}, plan={self.plan!r}, "
                f"switched={self.switched}, by_structure={self.by_structure}, "
                f"fell_back={self.fell_back})")


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


class _Slot:
    """One live activation storage and the aliases our handles keep of it."""

    __slots__ = ("aliases", "group", "swap", "ordinal", "order", "issued", "due", "__weakref__")

    def __init__(self, swap: bool, ordinal: int) -> None:
        self.aliases: list[torch.Tensor] = []
        self.group: SwapTensors | None = None
        self.swap = swap
        self.ordinal = ordinal
        self.order = -1
        self.issued = self.due = 0  # logical layers its device-to-host copy started / is waited in

    def releasable(self) -> bool:
        """True when nothing but our aliases holds the storage (see Note: [When a saved tensor may leave])."""
        return outside_holders(self.aliases) == 0  # Note: [Ownership rule] in runtime/ownership.py


class _Handle:
    """What autograd keeps for a saved tensor we track.

    ``live`` is its pack order in its micro-batch (the profile's record index); ``index`` its
    position in the plan its micro-batch runs (-1: unmatched).
    """

    __slots__ = ("slot", "tensor", "index", "live", "unit", "version", "__weakref__")

    def __init__(self, slot: _Slot | None, tensor: torch.Tensor, index: int, live: int,
                 unit: _MicroBatch) -> None:
        self.slot, self.tensor, self.index, self.live, self.unit = slot, tensor, index, live, unit
        self.version = _version(tensor)

    @property
    def planned(self) -> bool:
        return self.index >= 0 and self.unit.policy is not None


class _MicroBatch:
    """State of one forward + backward of a step: its plan, its matcher and what it saved."""

    def __init__(self, policy: SwapPolicy | None, window: int, record: bool) -> None:
        self.policy = policy
        self.window = window
        self.matcher = OnlineMatcher(policy.keys, window) if policy else None
        self.by_structure = False
        self.report = MicroBatchReport(keys=[], profile=DetailedProfile() if record else None)
        self.classes: list[int] = []  # structure keys (shape-free), forward order
        self.handles: list[weakref.ref | None] = []  # per live index
        self.by_index: dict[int, weakref.ref] = {}  # plan position -> slot
        self.released: list[weakref.ref] = []  # swapped slots in release order
        self.group = 0  # logical layer of the plan the forward is in
        self.misses = 0  # saved tensors its plan did not match

    @property
    def profile(self) -> DetailedProfile | None:
        return self.report.profile

    def entry_swap(self, pos: int) -> bool:
        return self.policy.entries[pos].swap


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``t``'s storage that shares its version counter but not its lifetime."""
    return t.detach()


def _version(t: torch.Tensor) -> int:
    """The version counter of ``t``'s data (a DTensor's in-place ops bump its local tensor's)."""
    if type(t) is torch.Tensor:  # the common case, before the subclass lookup
        return t._version
    return t._local_tensor._version if is_dtensor(t) else t._version


def _check_version(handle: _Handle) -> None:
    # Note: autograd skips its own version check for tensors saved through hooks; the alias
    # shares the saved tensor's version counter, so an in-place write is still caught here.
    if _version(handle.tensor) != handle.version:
        t = handle.tensor
        raise RuntimeError(
            f"swap_pass.SmartSwap: a tensor saved for backward (shape {tuple(t.shape)}, {t.dtype}) "
            f"was modified by an inplace operation after it was saved (version {handle.version} -> "
            f"{_version(t)}). A saved tensor must not be written before backward; clone it first."
        )


def measure_copy_bandwidth(device: torch.device, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Device-to-host copy bandwidth in bytes/s, timed on ``device`` (best of ``repeats``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_async_device(device))
    best = float("inf")
    for _ in range(repeats):
        if is_async_device(device):
            torch.accelerator.synchronize(device)
        t0 = now()
        dst.copy_(src)
        if is_async_device(device):
            torch.accelerator.synchronize(device)
        best = min(best, now() - t0)
    return nbytes / max(best, 1e-9)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (recompute, double backward)."""
    return torch._C._current_graph_task_id() != -1


class SmartExecutor:
    """Pack/unpack hooks for one model; one instance lives as long as its :class:`SmartSwap`.

    Args:
        swap_config: Runtime knobs for the :class:`SwapTensors` groups (host caps, streams).
        min_swap_bytes: Storages below this are never moved.
        match_window: :class:`OnlineMatcher` window.
        miss_limit: Consecutive unmatched tensors after which a planned step turns conservative.
        conservative_prefetch: In conservative steps, storages (in reverse release order)
            brought back ahead of the one being read.

    Attributes:
        candidates: Returns the cached plans a planned micro-batch may switch to, most recently
            used first. Default: none.
        record_planned: Planned steps also record a :class:`DetailedProfile` (so that a new
            shape is planned from its first step). Default: ``False``.
    """

    def __init__(self, swap_config: SwapConfig, *, min_swap_bytes: int, match_window: int,
                 miss_limit: int, conservative_prefetch: int = 1) -> None:
        self.swap_config = swap_config
        self.min_swap_bytes = min_swap_bytes
        self.match_window = match_window
        self.miss_limit = miss_limit
        self.conservative_prefetch = conservative_prefetch
        self.state_ptrs: set[int] = set()
        self.where = "SmartSwap"
        self.fqn = lambda: ""
        self.in_forward = lambda: False
        self.candidates = lambda: ()
        self.record_planned = False
        self.begin_step(ExecMode.CONSERVATIVE, None)

    # --- step and micro-batch boundaries ------------------------------------------------------

    def begin_step(self, mode: ExecMode, policy: SwapPolicy | None) -> None:
        """Start a step in ``mode`` (``policy`` is required for ``PLANNED``)."""
        if mode == ExecMode.PLANNED and policy is None:
            raise ValueError("swap_pass.SmartSwap: a planned step got no policy. It must have one.")
        self.step_mode, self.policy = mode, policy
        self.report = StepReport(keys=[], signature=0, mode=mode)
        self.tick = 0
        self._t_transfer = 0.0
        self._n_storages = 0
        self._inflight: list[_Slot] = []  # swap_to_host issued, wait_d2h not yet
        self._begin_micro_batch()

    def _begin_micro_batch(self) -> None:
        """Reset the per-pass state: every micro-batch of a step runs the plan from its start."""
        self._complete_inflight()
        self.mode = self.step_mode
        record = self.mode == ExecMode.DETAILED or (self.mode == ExecMode.PLANNED and self.record_planned)
        self.unit = _MicroBatch(self.policy if self.mode == ExecMode.PLANNED else None,
                                self.match_window, record)
        self.report.units.append(self.unit.report)
        self.report.micro_batches += 1
        self.backward = False
        self._slots: dict[int, weakref.ref] = {}  # storage _cdata -> slot
        self._pending: list[weakref.ref] = []  # slots waiting for their last holder to let go
        self._kept: list[weakref.ref] = []  # tracked slots a planned step keeps on the device
        self._miss_streak = 0

    def end_step(self, step_s: float) -> StepReport:
        """Finish the step: complete copies, close the profiles, return the :class:`StepReport`."""
        self._complete_inflight()
        rep = self.report
        self._close_unit()
        for unit in rep.units:  # step time and copy time shared evenly by the micro-batches
            if unit.profile is not None:
                unit.profile.step_s = step_s / rep.micro_batches
                unit.profile.transfer_s = self._t_transfer / rep.micro_batches
        first = rep.units[0]
        rep.keys, rep.profile = first.keys, first.profile
        rep.signature = hash(tuple(rep.keys))
        return rep

    def _close_unit(self) -> None:
        unit = self.unit
        unit.report.plan = unit.policy if self.mode == ExecMode.PLANNED else None
        unit.report.by_structure = unit.by_structure
        if unit.profile is not None:
            unit.profile.end_tick = self.tick

    # --- forward ------------------------------------------------------------------------------

    def poll(self) -> None:
        """Swap out every pending storage nobody but us holds (called at packs and module exits)."""
        self.tick += 1
        self._complete_due()
        if self.backward or not self._pending:
            return
        keep = []
        for ref in self._pending:
            slot = ref()
            if slot is None or slot.group is not None:
                continue
            if slot.releasable():
                self._release(slot)
            else:
                keep.append(ref)
        self._pending = keep

    def pack(self, t: torch.Tensor):
        """The pack hook."""
        self.poll()
        if self.backward:
            if _in_backward():  # saved during backward (double backward, recompute): leave it
                return t
            self._close_unit()  # a new forward after a backward: the next micro-batch
            self._begin_micro_batch()
        local = local_of(t)  # Note: [Saved DTensors] in saved_local.py
        if type(local) is SkipReason:  # sparse, nested, other subclasses: never read a storage
            self._skip(t, local)
            return t
        storage = local.untyped_storage()
        is_state = storage.data_ptr() in self.state_ptrs
        op, fqn = op_name(t), self.fqn()
        state = state_key(t, storage, self.state_ptrs)
        key = feature_key(op, fqn, t.dtype, t.shape, state)
        unit = self.unit
        live = len(unit.report.keys)
        unit.report.keys.append(key)
        unit.classes.append(feature_key(op, fqn, t.dtype, len(t.shape), state))
        pos = None
        if unit.policy is not None and self.mode == ExecMode.PLANNED:
            pos = self._match(key, storage.nbytes(), is_state)
            self._complete_due()  # a new logical layer may have begun
        handle = self._handle(t, local, storage, is_state, pos, live)
        if unit.profile is not None:
            self._record(t, storage, op, fqn, key, live, handle)
        unit.handles.append(weakref.ref(handle) if type(handle) is _Handle else None)
        return handle

    def _skip(self, t: torch.Tensor, reason: SkipReason) -> None:
        """Count a saved tensor SmartSwap cannot move (see saved_local.py); autograd keeps it."""
        what = ("nested" if t.is_nested else f"sparse ({t.layout})" if t.layout != torch.strided
                else f"{type(t).__name__} (a tensor subclass)")
        record_skip(reason, storage_nbytes(t), where=self.where,
                    detail=f"SmartSwap leaves {what} saved tensors to autograd: they have no one "
                           "plain storage to free and restore.")

    def _handle(self, t, local, storage, is_state: bool, pos: int | None, live: int):
        """Track ``t`` if it may move (or the profile needs it); else a plain handle or ``t``."""
        unit = self.unit
        big = storage.nbytes() >= max(self.min_swap_bytes, 1)
        if pos is not None:
            swap = unit.entry_swap(pos)
        else:  # conservative, or unmatched after a fallback (maybe this very miss)
            swap = big and self.mode != ExecMode.PLANNED
        index = -1 if pos is None else pos
        if not is_state and is_valid_for_swap(local) and (swap or big or unit.profile is not None):
            return self._track(t, storage, swap, index, live)
        if pos is not None or unit.profile is not None:
            return _Handle(None, t, index, live, unit)
        return t

    def _match(self, key: int, nbytes: int, is_state: bool) -> int | None:
        unit = self.unit
        j = unit.matcher.match(unit.classes[-1] if unit.by_structure else key)
        if j is None and not is_state and self.mode == ExecMode.PLANNED:
            j = self._switch_plan(key, nbytes)
        if not is_state:  # model state matches whatever the activations do: it proves nothing
            self._miss_streak = 0 if j is not None else self._miss_streak + 1
        if j is None:
            unit.misses += 1
            self.report.unmatched += 1
            if self._miss_streak >= self.miss_limit and self.mode == ExecMode.PLANNED:
                self._fall_back()
        else:
            self.report.matched += 1
            unit.group = unit.policy.entries[j].group
        return j

    def _fall_back(self) -> None:
        """Turn conservative for the rest of the micro-batch, and swap what the plan kept so far.

        Note: [Falling back mid-step]
        A planned step whose sequence changed keeps what the old plan kept (and every unmatched
        tensor) until ``miss_limit`` misses in a row. Those tensors are tracked, not swapped;
        here they become swappable and go back to the pending list, so they leave as soon as
        nothing but autograd holds them, exactly as in a conservative step. Without this the
        change step kept them all and passed the budget (by 21% on the CPU model, 12 -> 24
        tokens); see tests/smart/test_smart_swap.py.
        """
        self.mode, self.report.fell_back = ExecMode.CONSERVATIVE, True
        self.unit.report.fell_back = True
        floor = max(self.min_swap_bytes, 1)
        for ref in self._kept:  # tracked for the profile too: only those worth moving go
            slot = ref()
            if slot is not None and slot.aliases[0].untyped_storage().nbytes() >= floor:
                slot.swap = True
        self._pending += self._kept  # poll() skips slots already moved and those kept
        self._kept = []

    # --- choosing a cached plan mid-step --------------------------------------------------------

    def _switch_plan(self, key: int, nbytes: int) -> int | None:
        """On a miss, run the cached plan that fits this micro-batch so far; its position of ``key``.

        Note: [Choosing a cached plan mid-step]
        A step's signature is known only at its end, but the first saved tensor whose shape
        changed (the embedding's input, for a new sequence length) already misses the plan in
        force. Then every cached plan is tried on the keys saved so far: one that matches them
        all (an exact earlier shape) is taken at once; else a plan of the same *structure* (the
        same keys with the shapes left out) made for a larger shape, the smallest such: its
        choice keeps at most what it kept at the larger shape, so under a byte budget the peak
        can only be lower. The storages tracked so far are re-tagged by the new plan, so the
        switch is as if the step had started with it.
        """
        unit = self.unit
        best = None
        for plan in self.candidates():
            found = self._try_plan(plan, key, nbytes, by_structure=False)
            found = found or self._try_plan(plan, key, nbytes, by_structure=True)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        if best is None or best[0][1] > unit.misses:  # the plan in force missed this key too
            return None
        _, plan, matcher, positions, by_structure = best
        self._retag(plan, matcher, positions, by_structure)
        return positions[-1]

    def _try_plan(self, plan: SwapPolicy, key: int, nbytes: int, *, by_structure: bool):
        unit = self.unit
        if plan is unit.policy and not by_structure:
            return None
        matcher = OnlineMatcher(plan.class_keys if by_structure else plan.keys, self.match_window)
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

    def _retag(self, plan: SwapPolicy, matcher: OnlineMatcher, positions: list, by_structure: bool) -> None:
        unit = self.unit
        unit.policy, unit.matcher, unit.by_structure = plan, matcher, by_structure
        unit.report.switched = True
        unit.by_index = {}
        slots = {}
        for ref, pos in zip(unit.handles, positions):
            handle = ref() if ref is not None else None
            if handle is None:
                continue
            handle.index = -1 if pos is None else pos
            if handle.slot is not None and handle.slot.group is None:
                slot = handle.slot
                swap = slots.get(id(slot), (slot, False))[1] or (pos is not None and plan.entries[pos].swap)
                slots[id(slot)] = (slot, swap)
            if handle.slot is not None and pos is not None:
                unit.by_index[pos] = weakref.ref(handle.slot)
        self._kept = []
        for slot, swap in slots.values():
            slot.swap = swap
            (self._pending if swap else self._kept).append(weakref.ref(slot))

    # --- tracking and releasing -----------------------------------------------------------------

    def _track(self, t: torch.Tensor, storage, swap: bool, index: int, live: int) -> _Handle:
        ref = self._slots.get(storage._cdata)
        slot = ref() if ref is not None else None
        if slot is None or slot.group is not None:
            slot = self._new_slot(storage, swap)
        slot.swap = slot.swap or swap
        alias = _alias(t)  # a DTensor's detach() is a DTensor over a new local alias
        slot.aliases.append(local_of(alias))
        unit = self.unit
        if index >= 0:
            unit.by_index[index] = weakref.ref(slot)
        if self.mode == ExecMode.PLANNED and not slot.swap:
            self._kept.append(weakref.ref(slot))
        return _Handle(slot, alias, index, live, unit)

    def _new_slot(self, storage, swap: bool) -> _Slot:
        slot = _Slot(swap, self._n_storages)
        self._n_storages += 1
        self._slots[storage._cdata] = weakref.ref(slot)
        self._pending.append(weakref.ref(slot))
        profile = self.unit.profile
        if profile is not None:
            slot.ordinal = len(profile.storages)
            profile.storages.append(StorageLife(nbytes=storage.nbytes(), packed=self.tick))
            weakref.finalize(slot, self._on_drop, profile, slot.ordinal)
        return slot

    def _record(self, t, storage, op, fqn, key, live, handle) -> None:
        slot = handle.slot if type(handle) is _Handle else None
        ordinal = slot.ordinal if slot is not None else -1
        profile = self.unit.profile
        profile.records.append(SavedRecord(
            index=live, op=op, fqn=fqn, dtype=t.dtype, shape=tuple(t.shape),
            nbytes=storage.nbytes(), key=key, storage=ordinal, cls=self.unit.classes[-1],
            tick=self.tick))
        if slot is not None:
            profile.storages[ordinal].entries.append(live)

    def _on_drop(self, profile: DetailedProfile, ordinal: int) -> None:
        self.tick += 1
        if profile.storages[ordinal].dropped is None:
            profile.storages[ordinal].dropped = self.tick

    def _release(self, slot: _Slot) -> None:
        self._mark_off(slot)
        if not slot.swap:
            return
        t0 = now()
        group = SwapTensors(slot.aliases, config=self.swap_config, name=f"smart#{slot.ordinal}")
        slot.group = group
        group.swap_to_host()
        slot.issued, slot.due = self.unit.group, self._due()
        if slot.due > self.unit.group or (group.device is not None and is_async_device(group.device)):
            self._inflight.append(slot)  # see Note: [Waiting for a copy a logical layer later]
        else:
            group.wait_d2h()
        self._t_transfer += now() - t0
        slot.order = len(self.unit.released)
        self.unit.released.append(weakref.ref(slot))
        self.report.swapped_storages += 1
        self.report.swapped_bytes += group.nbytes

    def _due(self) -> int:
        """Logical layer at whose first saved tensor a copy started now is waited for.

        Note: [Waiting for a copy a logical layer later]
        A planned step waits for a device-to-host copy (and frees its storage) only when the
        forward reaches the first saved tensor of logical layer ``g + policy.overlap_groups``,
        ``g`` being the layer the copy started in: with ``overlap_groups >= 1`` a copy runs
        behind the rest of its layer and, at 2, behind the whole next one. The policy chose
        that lag so that the storages held longer still fit the budget (it replays exactly
        these free points), and takes a smaller one only where the budget requires. Backward's
        start waits for all. Conservative steps wait at the next poll (about one op later).
        """
        unit = self.unit
        if self.mode == ExecMode.PLANNED and unit.policy is not None:
            return unit.group + unit.policy.overlap_groups
        return unit.group

    def _mark_off(self, slot: _Slot) -> None:
        """Profile: from this tick the storage could be (or is) off the device."""
        profile = self.unit.profile
        if profile is not None and profile.storages[slot.ordinal].released is None:
            profile.storages[slot.ordinal].released = self.tick

    def _complete_due(self) -> None:
        """Wait for the copies whose logical layer has come (all of them in backward)."""
        if not self._inflight:
            return
        now_group = self.unit.group if not self.backward else float("inf")
        if self.mode != ExecMode.PLANNED:  # conservative: at the next poll
            now_group = float("inf")
        waiting = []
        for slot in self._inflight:
            if slot.due > now_group:
                waiting.append(slot)
            else:
                self._wait_d2h(slot, self.unit.group)
        self._inflight = waiting

    def _complete_inflight(self) -> None:
        """Wait for every copy (start of backward, end of a micro-batch or step)."""
        if not self._inflight:
            return
        plan = self.unit.policy
        for slot in self._inflight:
            self._wait_d2h(slot, plan.num_groups if plan is not None else self.unit.group)
        self._inflight = []

    def _wait_d2h(self, slot: _Slot, at: int) -> None:
        if slot.group.stat != D2H:
            return
        slot.group.wait_d2h()
        if self.mode == ExecMode.PLANNED:
            self.report.d2h_waits.append((slot.issued, at))

    # --- backward -----------------------------------------------------------------------------

    def unpack(self, handle):
        """The unpack hook: data back on the device before anyone reads it, then prefetch."""
        if type(handle) is not _Handle:
            return handle
        if not self.backward:
            if self.in_forward():  # Note: [Reads of saved tensors inside the forward]
                return self._read_in_forward(handle)
            self._start_backward()
        self.tick += 1
        slot = handle.slot
        if slot is not None and slot.group is not None:
            if slot.group.stat != DEVICE:
                self.report.sync_restores += slot.group.stat != H2D
                self._timed(slot.group.restore)
            slot.group.assert_on_device("SmartSwap.unpack")
        _check_version(handle)
        if handle.unit.profile is not None:
            self._record_unpack(handle)
        self._prefetch_after(handle)
        return handle.tensor

    def _read_in_forward(self, handle: _Handle) -> torch.Tensor:
        """A saved tensor read while the model's forward still runs: its data, nothing else.

        Note: [Reads of saved tensors inside the forward]
        ``torch.autograd.grad`` called inside a forward (a gradient penalty, a physics loss) and
        reads of ``grad_fn._saved_*`` unpack saved tensors before the backward of the step. They
        are not its start: the forward goes on, and what it saves next belongs to the same
        micro-batch. So such an unpack only brings its storage back if it had left (it then
        stays on the device for the rest of the step) and checks its version; it neither ends
        the forward's swapping nor counts as a backward read in the profile. An unpack while the
        model's root module is not running starts the backward, as before.
        """
        slot = handle.slot
        if slot is not None and slot.group is not None and slot.group.stat != DEVICE:
            self._timed(slot.group.restore)
            slot.group.assert_on_device("SmartSwap.unpack")
        _check_version(handle)
        return handle.tensor

    def _start_backward(self) -> None:
        self._complete_inflight()
        self.backward = True
        self._pending = []
        profile = self.unit.profile
        if profile is not None and profile.backward_tick is None:
            profile.backward_tick = self.tick + 1

    def _record_unpack(self, handle: _Handle) -> None:
        profile = handle.unit.profile
        profile.unpack_ticks.append((self.tick, handle.live))
        rec = profile.records[handle.live]
        if rec.bwd_order < 0:
            rec.bwd_order = len(profile.unpack_ticks) - 1
        if handle.slot is not None and profile.storages[handle.slot.ordinal].unpacked is None:
            profile.storages[handle.slot.ordinal].unpacked = self.tick

    def _prefetch_after(self, handle: _Handle) -> None:
        unit, slot = handle.unit, handle.slot
        if handle.planned:
            targets = (unit.by_index.get(j) for j in unit.policy.prefetch.get(handle.index, ()))
        elif slot is not None and slot.order >= 0 and self.conservative_prefetch:
            lo = max(slot.order - self.conservative_prefetch, 0)
            targets = iter(unit.released[lo:slot.order])
        else:
            return
        for ref in targets:
            target = ref() if ref is not None else None
            if target is not None and target.group is not None and target.group.stat == HOST:
                self._timed(target.group.swap_to_device)

    def _timed(self, fn) -> None:
        t0 = now()
        fn()
        self._t_transfer += now() - t0
