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

import weakref

import torch

from swap_pass.config import SwapConfig
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime.device import is_async_device
from swap_pass.runtime.skips import SkipReason, record_skip
from swap_pass.runtime.swap_tensors import (
    D2H,
    DEVICE,
    H2D,
    HOST,
    SwapTensors,
    is_valid_for_swap,
)
from swap_pass.smart.bandwidth import CopyClock, measure_copy_bandwidth
from swap_pass.smart.matcher import OnlineMatcher
from swap_pass.smart.policy import SwapPolicy
from swap_pass.smart.profiler import (
    DetailedProfile,
    SavedRecord,
    StorageLife,
    feature_key,
    op_name,
    state_key,
)
from swap_pass.smart.reports import ExecMode, MicroBatchReport, StepReport
from swap_pass.smart.saved_handles import (
    Handle,
    MicroBatch,
    Slot,
    alias_of,
    check_version,
)
from swap_pass.smart.saved_local import local_of, storage_nbytes, wait_collective

# Re-exported: the reports, the matcher and the bandwidth probe lived here before.
__all__ = ["ExecMode", "MicroBatchReport", "OnlineMatcher", "SmartExecutor", "StepReport",
           "measure_copy_bandwidth"]


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (recompute, double
    backward)."""
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
        self.left_out = lambda fqn: False  # the user's module_filter_fn refuses the module
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
        self._clock = CopyClock()  # the step's copy time: see Note: [Timing on the device]
        self._n_storages = 0
        # swap_to_host issued, wait_d2h not yet; weak: a slot whose graph died (a forward
        # without backward) gives its host buffer back at once (SwapTensors.__del__ orders
        # that after its copy), not at the next poll or step
        self._inflight: list[weakref.ref] = []
        self._units: list[MicroBatch] = []  # this step's micro-batches, oldest first
        self._begin_micro_batch()

    def forget_pending(self) -> None:
        """Start the current step's bookkeeping again (:func:`swap_pass.reset` restored every
        group); the mode and plan stay. Tensors saved before still restore at their unpack."""
        self.begin_step(self.step_mode, self.policy)

    def _begin_micro_batch(self) -> None:
        """Reset the per-pass state: every micro-batch of a step runs the plan from its start.

        Note: [Micro-batches in flight]
        A plan covers one micro-batch: its forward, then its backward. Gradient accumulation
        runs them one after another. A pipeline schedule such as 1F1B runs a micro-batch's
        forward while earlier micro-batches still wait for their backward: what their plans
        kept on the device for that backward would come on top of the new micro-batch's plan,
        and the step would pass the budget (on the first stage of a 2-stage 1F1B, 0.59 of the
        unswapped peak at ``memory_budget=0.5``). So when a micro-batch begins, the storages
        that earlier micro-batches still holding saved tensors keep on the device, and that
        nobody but autograd holds, go to the host (:meth:`_evict`, waited for at once); they
        come back at their unpack or their plan's prefetch. The earlier micro-batches' backward
        restores then run next to the new micro-batch's kept tensors, which no plan models.
        ``MicroBatchReport.in_flight``, ``StepReport.max_in_flight`` and
        ``StepReport.evicted_bytes`` report it. GPipe-like schedules (every forward before any
        backward) are one sequence to the executor and planned as one.
        """
        self._complete_inflight()
        self.mode = self.step_mode
        record = (self.mode == ExecMode.DETAILED
                  or (self.mode == ExecMode.PLANNED and self.record_planned))
        self._units = [u for u in self._units if u.holds_saved()]
        self._evict(self._units)
        self.unit = MicroBatch(self.policy if self.mode == ExecMode.PLANNED else None,
                                self.match_window, record)
        self._units.append(self.unit)
        self.unit.report.in_flight = len(self._units)
        self.report.max_in_flight = max(self.report.max_in_flight, len(self._units))
        self.report.units.append(self.unit.report)
        self.report.micro_batches += 1
        self.backward = False
        self._slots: dict[int, weakref.ref] = {}  # storage _cdata -> slot
        self._pending: list[weakref.ref] = []  # slots waiting for their last holder to let go
        self._kept: list[weakref.ref] = []  # tracked slots a planned step keeps on the device
        self._miss_streak = 0

    def _evict(self, units: list[MicroBatch]) -> None:
        """Move to the host what ``units`` (earlier micro-batches still waiting for their
        backward) keep on the device: see Note: [Micro-batches in flight]."""
        floor = max(self.min_swap_bytes, 1)
        for unit in units:
            for ref in unit.handles:
                handle = ref() if ref is not None else None
                slot = handle.slot if handle is not None else None
                if (slot is None or slot.group is not None
                        or slot.aliases[0].untyped_storage().nbytes() < floor
                        or not slot.releasable()):
                    continue
                group = self._timed(lambda s=slot: _waited(self._swap_out(s)),
                                    slot.aliases[0].device, to_host=True)
                profile = unit.profile
                if profile is not None and profile.storages[slot.ordinal].released is None:
                    profile.storages[slot.ordinal].released = self.tick
                self.report.evicted_bytes += group.nbytes

    def end_step(self, step_s: float) -> StepReport:
        """Finish the step: complete copies, close the profiles, return the :class:`StepReport`."""
        self._complete_inflight()
        rep = self.report
        self._close_unit()
        # A planned step (the steady state) counts the copies finished by now, waiting for none.
        transfer_s = None
        for unit in rep.units:  # step time and copy time shared evenly by the micro-batches
            if unit.profile is not None:
                if transfer_s is None:
                    transfer_s = self._clock.seconds(wait=self.step_mode != ExecMode.PLANNED)
                unit.profile.step_s = step_s / rep.micro_batches
                unit.profile.transfer_s = transfer_s / rep.micro_batches
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
        if not swap_allowed():  # Note: [Opting out] in swap_pass/opt_out.py
            record_skip(SkipReason.NO_SWAP, storage_nbytes(t), where=self.where)
            return t
        if self.left_out(self.fqn()):
            record_skip(SkipReason.MODULE_FILTER, storage_nbytes(t), where=self.where)
            return t
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
        unit.handles.append(weakref.ref(handle) if type(handle) is Handle else None)
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
            return Handle(None, t, index, live, unit)
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
        """On a miss, run the cached plan that fits this micro-batch so far; its position of
        ``key``.

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

    def _retag(self, plan: SwapPolicy, matcher: OnlineMatcher, positions: list,
               by_structure: bool) -> None:
        unit = self.unit
        unit.policy, unit.matcher, unit.by_structure = plan, matcher, by_structure
        unit.report.switched = True
        unit.by_index = {}
        slots = {}
        # positions also covers the tensor being saved now, whose handle is not in
        # unit.handles yet
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
                unit.by_index[pos] = weakref.ref(handle.slot)
        self._kept = []
        for slot, swap in slots.values():
            slot.swap = swap
            (self._pending if swap else self._kept).append(weakref.ref(slot))

    # --- tracking and releasing -----------------------------------------------------------------

    def _track(self, t: torch.Tensor, storage, swap: bool, index: int, live: int) -> Handle:
        ref = self._slots.get(storage._cdata)
        slot = ref() if ref is not None else None
        if slot is None or slot.group is not None:
            slot = self._new_slot(storage, swap)
        slot.swap = slot.swap or swap
        wait_collective(t)  # Note: [Saved AsyncCollectiveTensors] in saved_local.py
        alias = alias_of(t)  # a DTensor's detach() is a DTensor over a new local alias
        slot.aliases.append(local_of(alias))
        unit = self.unit
        if index >= 0:
            unit.by_index[index] = weakref.ref(slot)
        if self.mode == ExecMode.PLANNED and not slot.swap:
            self._kept.append(weakref.ref(slot))
        return Handle(slot, alias, index, live, unit)

    def _new_slot(self, storage, swap: bool) -> Slot:
        slot = Slot(swap, self._n_storages)
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
        slot = handle.slot if type(handle) is Handle else None
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

    def _release(self, slot: Slot) -> None:
        self._mark_off(slot)
        if not slot.swap:
            return
        self._timed(lambda: self._start_release(slot), slot.aliases[0].device, to_host=True)
        slot.order = len(self.unit.released)
        self.unit.released.append(weakref.ref(slot))

    def _start_release(self, slot: Slot) -> None:
        group = self._swap_out(slot)
        slot.issued, slot.due = self.unit.group, self._due()
        if (slot.due > self.unit.group
                or (group.device is not None and is_async_device(group.device))):
            # see Note: [Waiting for a copy a logical layer later]
            self._inflight.append(weakref.ref(slot))
        else:
            group.wait_d2h()

    def _swap_out(self, slot: Slot) -> SwapTensors:
        """Start ``slot``'s device-to-host copy in a group of its own, counted in the report."""
        group = SwapTensors(slot.aliases, config=self.swap_config, name=f"smart#{slot.ordinal}")
        slot.group = group
        group.swap_to_host()
        self.report.swapped_storages += 1
        self.report.swapped_bytes += group.nbytes
        return group

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

    def _mark_off(self, slot: Slot) -> None:
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
        for ref in self._inflight:
            slot = ref()
            if slot is None:
                continue
            if slot.due > now_group:
                waiting.append(ref)
            else:
                self._wait_d2h(slot, self.unit.group)
        self._inflight = waiting

    def _complete_inflight(self) -> None:
        """Wait for every copy (start of backward, end of a micro-batch or step)."""
        if not self._inflight:
            return
        plan = self.unit.policy
        for ref in self._inflight:
            slot = ref()
            if slot is not None:
                self._wait_d2h(slot, plan.num_groups if plan is not None else self.unit.group)
        self._inflight = []

    def _wait_d2h(self, slot: Slot, at: int) -> None:
        if slot.group.stat != D2H:
            return
        slot.group.wait_d2h()
        if self.mode == ExecMode.PLANNED:
            self.report.d2h_waits.append((slot.issued, at))

    # --- backward -----------------------------------------------------------------------------

    def unpack(self, handle):
        """The unpack hook: data back on the device before anyone reads it, then prefetch."""
        if type(handle) is not Handle:
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
                self._timed(slot.group.restore, slot.group.device)
            slot.group.assert_on_device("SmartSwap.unpack")
        check_version(handle)
        if handle.unit.profile is not None:
            self._record_unpack(handle)
        self._prefetch_after(handle)
        return handle.tensor

    def _read_in_forward(self, handle: Handle) -> torch.Tensor:
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
            self._timed(slot.group.restore, slot.group.device)
            slot.group.assert_on_device("SmartSwap.unpack")
        check_version(handle)
        return handle.tensor

    def _start_backward(self) -> None:
        self._complete_inflight()
        self.backward = True
        self._pending = []
        profile = self.unit.profile
        if profile is not None and profile.backward_tick is None:
            profile.backward_tick = self.tick + 1

    def _record_unpack(self, handle: Handle) -> None:
        profile = handle.unit.profile
        profile.unpack_ticks.append((self.tick, handle.live))
        rec = profile.records[handle.live]
        if rec.bwd_order < 0:
            rec.bwd_order = len(profile.unpack_ticks) - 1
        if handle.slot is not None and profile.storages[handle.slot.ordinal].unpacked is None:
            profile.storages[handle.slot.ordinal].unpacked = self.tick

    def _prefetch_after(self, handle: Handle) -> None:
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
                self._timed(target.group.swap_to_device, target.group.device)

    def _timed(self, fn, device: torch.device, *, to_host: bool = False):
        """``fn()``, its copies counted in the step's copy time (Note: [Timing on the device])."""
        return self._clock.time_copies(fn, device, to_host=to_host,
                                       use_streams=self.swap_config.use_streams)


def _waited(group: SwapTensors) -> SwapTensors:
    """``group`` once its device-to-host copy was waited for (its storages freed)."""
    group.wait_d2h()
    return group
