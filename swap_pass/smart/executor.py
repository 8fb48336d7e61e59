"""SmartSwap's executor: ``saved_tensors_hooks`` that carry out a policy through the shared runtime.

Per saved tensor (pack)::

    poll: any storage that only our aliases still hold -> SwapTensors(aliases).swap_to_host()
          (+ wait_d2h(), storage freed: in planned steps ``policy.overlap_groups`` logical
          layers later, see Note: [Waiting for a copy a logical layer later]; else at once on
          CPU, at the next poll on an accelerator)
    key = (op, module call site, dtype, shape, model state)
    stable: the micro-batch's Follower matches key to the plan -> swap or keep (tracked, so a
          fallback can still move it: Note: [Falling back mid-step]); a miss may switch to a
          cached plan (Note: [Choosing a cached plan mid-step])
    conservative (warmup, gen_policy, stable after too many misses): every eligible activation
    -> handle(alias over the same storage) or the tensor itself (unmatched, state, not swappable)
    a forward after a backward: a new micro-batch, the plan restarts (gradient accumulation)

Per unpack: restore the storage from any state, assert it is on the device, then start the
prefetches the plan puts there. Every moved storage is restored before it is read, so a wrong
match can cost memory or a stall, never data.

Note: [When a saved tensor may leave]
Eager mode gives no op ids, so "after its last forward use" is read from reference counts: the
pack hook keeps an *alias* (a new tensor over the same storage), and a storage whose use count
equals the number of our aliases is held by nobody else (no Python variable, view, op argument
in flight or module buffer), so nothing reads it before backward unpacks it. Checking at every
pack and module exit is cheap.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from swap_pass.config import SwapConfig
from swap_pass.cost.probes import Timing, check_events, start_events, timing_for
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime import stats
from swap_pass.runtime.device import device_streams, is_async_device
from swap_pass.runtime.freeing import in_backward
from swap_pass.runtime.group import D2H, DEVICE, H2D, HOST, SwapTensors, is_valid_for_swap
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.smart.follower import Follower
from swap_pass.smart.policy import PlanCache, SwapPolicy
from swap_pass.smart.profiler import FeatureTracker, feature_key, now, op_name, state_key
from swap_pass.smart.recorder import Recorder, Ticks
from swap_pass.smart.reports import Stage, StepReport
from swap_pass.smart.saved import (
    Handle,
    MicroBatch,
    Slot,
    alias_of,
    check_version,
    local_of,
    storage_nbytes,
    wait_collective,
)

__all__ = ["CopyClock", "SmartExecutor"]


# --- SmartSwap's copy clock: the seconds its copies take in a step --------------------------------


T = TypeVar("T")


# Note: [One timed copy a step]
# torch_npu's ``elapsed_time`` flushes every task queue and synchronizes both events (a host
# stall per call; cheap on CUDA), so on an accelerator the clock times only the first copy call
# that moves bytes in each period (a step: one :meth:`CopyClock.seconds` to the next) and counts
# the others' bytes; :meth:`CopyClock.seconds` scales the sample's seconds per byte to them all
# once it completed (a steady-state step reads it a step later, never waiting). A step's copies
# are layer inputs of one size on one link: the sample stands for the rest (a planning figure).


class CopyClock:
    """Seconds SmartSwap's copies take in a step, timed as :class:`Timing` says.

    ``Timing.HOST`` adds each call's host time (CPU copies are synchronous). ``Timing.EVENTS``
    times one copy call a step with events on its side stream and scales it by bytes: the
    copies' own time, not their enqueue's. See Note: [One timed copy a step] and
    Note: [Timing on the device] in :mod:`swap_pass.cost.probes`.
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
            wait: Wait for the sampled copy if still running; else a running copy leaves the
                period open for a later call (the steady state never waits). Default: ``True``.
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


# --- the executor: the saved-tensor hooks ---------------------------------------------------------


class SmartExecutor:
    """Pack/unpack hooks for one model; one instance lives as long as its :class:`SmartSwap`.

    Each micro-batch gets what its step's :class:`Stage` needs: ``warmup`` neither plan nor
    profile, ``gen_policy`` a :class:`Recorder`, ``stable`` a :class:`Follower` of the step's
    plan (and a :class:`Recorder` with a plan cache, so a new shape is planned from its first
    step). The executor owns the storages, their copies and the step's report; the recorder
    only records, the follower only decides.

    Args:
        swap_config: Runtime knobs for the :class:`SwapTensors` groups (host caps, streams).
        call_sites: The model's :class:`FeatureTracker`; :meth:`poll` is one of its
            post-forward callbacks.
        plan_cache: The plans a stable micro-batch may switch to, or None (no cache: stable
            steps do not record either).
        min_swap_bytes: Storages below this are never moved.
        match_window: :class:`OnlineMatcher` window.
        miss_limit: Consecutive unmatched tensors after which a planned step turns conservative.
        conservative_prefetch: In conservative steps, storages (in reverse release order)
            brought back ahead of the one being read. Default: ``1``.
        where: Name in skip records (``"SmartSwap(<model class>)"``). Default: ``"SmartSwap"``.
        left_out: ``fqn -> bool``: True for the modules the user's ``module_filter_fn``
            refuses. Default: ``None`` (none refused).
    """

    def __init__(self, swap_config: SwapConfig, *, call_sites: FeatureTracker,
                 plan_cache: PlanCache | None, min_swap_bytes: int, match_window: int,
                 miss_limit: int, conservative_prefetch: int = 1, where: str = "SmartSwap",
                 left_out=None) -> None:
        self.swap_config = swap_config
        self.call_sites = call_sites
        self.plan_cache = plan_cache
        self.min_swap_bytes = min_swap_bytes
        self.match_window = match_window
        self.miss_limit = miss_limit
        self.conservative_prefetch = conservative_prefetch
        self.where = where
        self.left_out = left_out
        self._ticks = Ticks()
        self.begin_step(Stage.WARMUP, None, set())

    # --- step and micro-batch boundaries ------------------------------------------------------

    def begin_step(self, stage: Stage, policy: SwapPolicy | None, state_ptrs: set[int]) -> None:
        """Start a step in ``stage`` (``policy`` is required for ``stable``; ``state_ptrs``:
        the data pointers of the model's parameter and buffer storages, never moved)."""
        if stage == Stage.STABLE and policy is None:
            raise ValueError("swap_pass.SmartSwap: a stable step got no policy. It must have one.")
        self.stage, self.policy, self._state_ptrs = stage, policy, state_ptrs
        self.report = StepReport(keys=[], signature=0, stage=stage)
        self._ticks.now = 0
        self._clock = CopyClock()  # the step's copy time: see Note: [Timing on the device]
        self._n_storages = 0
        # swap_to_host issued, wait_d2h not yet. Weak: a slot whose graph died (forward without
        # backward) gives its host buffer back at once, after its copy (SwapTensors.__del__)
        self._inflight: list[weakref.ref] = []
        self._units: list[MicroBatch] = []  # this step's micro-batches, oldest first
        self._begin_micro_batch()

    def forget_pending(self) -> None:
        """Start the current step's bookkeeping again (:func:`swap_pass.reset` restored every
        group); the stage and plan stay. Tensors saved before still restore at their unpack."""
        self.begin_step(self.stage, self.policy, self._state_ptrs)

    def _begin_micro_batch(self) -> None:
        """Start a micro-batch: it runs the plan from its start, with what its stage needs.

        Note: [Micro-batches in flight]
        A plan covers one micro-batch's forward then backward. A pipeline schedule such as 1F1B
        runs a forward while earlier micro-batches wait for their backward; what their plans kept
        would come on top of the new plan and pass the budget (0.59 of the unswapped peak at
        ``memory_budget=0.5``, first stage of a 2-stage 1F1B). So when a micro-batch begins, what
        earlier ones keep on the device and only autograd holds goes to the host (:meth:`_evict`,
        waited for at once), back at its unpack or plan's prefetch (beside the new micro-batch's
        kept tensors: no plan models that). Reported in ``MicroBatchReport.in_flight``,
        ``StepReport.max_in_flight`` and ``StepReport.evicted_bytes``. GPipe-like schedules
        (every forward before any backward) are one sequence to the executor, planned as one.
        """
        self._complete_inflight()
        units = [u for u in self._units if u.holds_saved()]
        self._evict(units)
        self.unit = MicroBatch(self._follower(), self._recorder())
        units.append(self.unit)
        self._units = units
        self.unit.report.in_flight = len(units)
        self.report.max_in_flight = max(self.report.max_in_flight, len(units))
        self.report.units.append(self.unit.report)
        self.report.micro_batches += 1

    def _follower(self) -> Follower | None:
        """A :class:`Follower` of the step's plan in ``stable`` steps, else None."""
        if self.stage != Stage.STABLE:
            return None
        cache = self.plan_cache
        return Follower(self.policy, window=self.match_window, miss_limit=self.miss_limit,
                        plans=cache.plans if cache is not None else tuple)

    def _recorder(self) -> Recorder | None:
        """A :class:`Recorder` in ``gen_policy`` steps and ``stable`` ones with a plan cache."""
        record = (self.stage == Stage.GEN_POLICY
                  or (self.stage == Stage.STABLE and self.plan_cache is not None))
        return Recorder(self._ticks) if record else None

    def _evict(self, units: list[MicroBatch]) -> None:
        """Send to the host what ``units`` keep on the device: Note: [Micro-batches in flight]."""
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
                if unit.recorder is not None:
                    unit.recorder.released(slot)
                self.report.evicted_bytes += group.nbytes

    def end_step(self, step_s: float) -> StepReport:
        """Finish the step: complete copies, close the profiles, return the :class:`StepReport`."""
        self._complete_inflight()
        rep = self.report
        self._close_unit()
        profiles = [unit.profile for unit in rep.units if unit.profile is not None]
        if profiles:  # step time and copy time shared evenly by the micro-batches
            # A stable step (the steady state) counts the copies finished by now, waiting for none.
            transfer_s = self._clock.seconds(wait=self.stage != Stage.STABLE)
            for profile in profiles:
                profile.step_s = step_s / rep.micro_batches
                profile.transfer_s = transfer_s / rep.micro_batches
        first = rep.units[0]
        rep.keys, rep.profile = first.keys, first.profile
        rep.signature = hash(tuple(rep.keys))
        return rep

    def _close_unit(self) -> None:
        unit = self.unit
        unit.report.plan = unit.policy if unit.following else None
        unit.report.by_structure = unit.follower is not None and unit.follower.by_structure
        if unit.recorder is not None:
            unit.recorder.close()

    # --- forward ------------------------------------------------------------------------------

    def poll(self) -> None:
        """Swap out every pending storage nobody but us holds (called at packs and module exits)."""
        self._ticks.advance()
        self._complete_due()
        unit = self.unit
        if unit.backward or not unit.pending:
            return
        keep = []
        for ref in unit.pending:
            slot = ref()
            if slot is None or slot.group is not None:
                continue
            if slot.releasable():
                self._release(slot)
            else:
                keep.append(ref)
        unit.pending = keep

    def pack(self, t: torch.Tensor):
        """The pack hook."""
        self.poll()
        if self.unit.backward:
            if in_backward():  # saved during backward (double backward, recompute): leave it
                return t
            self._close_unit()  # a new forward after a backward: the next micro-batch
            self._begin_micro_batch()
        if not swap_allowed():  # Note: [Opting out] in swap_pass/opt_out.py
            record_skip(SkipReason.NO_SWAP, storage_nbytes(t), where=self.where)
            return t
        fqn = self.call_sites.fqn
        if self.left_out is not None and self.left_out(fqn):
            record_skip(SkipReason.MODULE_FILTER, storage_nbytes(t), where=self.where)
            return t
        local = local_of(t)  # Note: [Saved DTensors] in saved.py
        if type(local) is SkipReason:  # sparse, nested, other subclasses: never read a storage
            self._skip(t, local)
            return t
        storage = local.untyped_storage()
        is_state = storage.data_ptr() in self._state_ptrs
        op = op_name(t)
        state = state_key(t, storage, self._state_ptrs)
        key = feature_key(op, fqn, t.dtype, t.shape, state)
        unit = self.unit
        live = len(unit.report.keys)
        unit.report.keys.append(key)
        unit.classes.append(feature_key(op, fqn, t.dtype, len(t.shape), state))
        pos = None
        if unit.following:
            pos = self._match(key, storage.nbytes(), is_state)
            self._complete_due()  # a new logical layer may have begun
        handle = self._handle(t, local, storage, is_state, pos, live)
        if unit.recorder is not None:
            unit.recorder.saved(t, storage.nbytes(), op, fqn, key, unit.classes[-1], live,
                                handle.slot if type(handle) is Handle else None)
        unit.handles.append(weakref.ref(handle) if type(handle) is Handle else None)
        return handle

    def _skip(self, t: torch.Tensor, reason: SkipReason) -> None:
        """Count a saved tensor SmartSwap cannot move (see saved.py); autograd keeps it."""
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
            swap = unit.follower.entry_swap(pos)
        else:  # conservative, or unmatched after a fallback (maybe this very miss)
            swap = big and not unit.following
        index = -1 if pos is None else pos
        record = unit.recorder is not None
        if not is_state and is_valid_for_swap(local) and (swap or big or record):
            return self._track(t, storage, swap, index, live)
        if pos is not None or record:
            return Handle(None, t, index, live, unit)
        return t

    def _match(self, key: int, nbytes: int, is_state: bool) -> int | None:
        """Plan position of the tensor being saved (counted); ``miss_limit`` misses fall back."""
        follower = self.unit.follower
        j = follower.match(self.unit, key, nbytes, is_state)
        if j is None:
            self.report.unmatched += 1
            if follower.lost():
                self._fall_back()
        else:
            self.report.matched += 1
        return j

    def _fall_back(self) -> None:
        """Turn conservative for the rest of the micro-batch, and swap what the plan kept so far.

        Note: [Falling back mid-step]
        A planned step whose sequence changed keeps what the old plan kept (and every unmatched
        tensor) until ``miss_limit`` misses in a row. Those tracked tensors become swappable here
        and rejoin the pending list, leaving once only autograd holds them, as in a conservative
        step. Without this the change step kept them all and passed the budget by 21% (CPU
        model, 12 -> 24 tokens; tests/smart/test_smart_swap.py).
        """
        unit = self.unit
        self.report.fell_back = unit.report.fell_back = True
        # poll() skips slots already moved and those kept
        unit.pending += unit.follower.fall_back(max(self.min_swap_bytes, 1))

    # --- tracking and releasing -----------------------------------------------------------------

    def _track(self, t: torch.Tensor, storage, swap: bool, index: int, live: int) -> Handle:
        unit = self.unit
        ref = unit.slots.get(storage._cdata)
        slot = ref() if ref is not None else None
        if slot is None or slot.group is not None:
            slot = self._new_slot(storage, swap)
        slot.swap = slot.swap or swap
        wait_collective(t)  # Note: [Saved AsyncCollectiveTensors] in saved.py
        alias = alias_of(t)  # a DTensor's detach() is a DTensor over a new local alias
        slot.aliases.append(local_of(alias))
        if index >= 0:
            unit.follower.by_index[index] = weakref.ref(slot)
        if unit.following and not slot.swap:
            unit.follower.kept.append(weakref.ref(slot))
        return Handle(slot, alias, index, live, unit)

    def _new_slot(self, storage, swap: bool) -> Slot:
        slot = Slot(swap, self._n_storages)
        self._n_storages += 1
        unit = self.unit
        unit.slots[storage._cdata] = weakref.ref(slot)
        unit.pending.append(weakref.ref(slot))
        if unit.recorder is not None:
            unit.recorder.add_storage(slot, storage.nbytes())
        return slot

    def _release(self, slot: Slot) -> None:
        if self.unit.recorder is not None:  # from now the storage could be off the device
            self.unit.recorder.released(slot)
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
        A planned step waits for a device-to-host copy (and frees its storage) at the first saved
        tensor of logical layer ``g + policy.overlap_groups``, ``g`` being the one it started in:
        at 1 it runs behind the rest of its layer, at 2 behind the next one too. The policy takes
        the longest lag that still fits the budget (it replays these free points). Backward's
        start waits for all; conservative steps wait at the next poll (about one op later).
        """
        unit = self.unit
        if unit.following:
            return unit.group + unit.policy.overlap_groups
        return unit.group

    def _complete_due(self) -> None:
        """Wait for the copies whose logical layer has come (all of them in backward)."""
        if not self._inflight:
            return
        unit = self.unit
        now_group = unit.group if not unit.backward else float("inf")
        if not unit.following:  # conservative: at the next poll
            now_group = float("inf")
        waiting = []
        for ref in self._inflight:
            slot = ref()
            if slot is None:
                continue
            if slot.due > now_group:
                waiting.append(ref)
            else:
                self._wait_d2h(slot, unit.group)
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
        if self.unit.following:
            self.report.d2h_waits.append((slot.issued, at))

    # --- backward -----------------------------------------------------------------------------

    def unpack(self, handle):
        """The unpack hook: data back on the device before anyone reads it, then prefetch."""
        if type(handle) is not Handle:
            return handle
        if not self.unit.backward:
            if self.call_sites.in_forward():  # Note: [Reads of saved tensors inside the forward]
                return self._read_in_forward(handle)
            self._start_backward()
        self._ticks.advance()
        slot = handle.slot
        if slot is not None and slot.group is not None:
            if slot.group.stat != DEVICE:
                self.report.sync_restores += slot.group.stat != H2D
                self._timed(slot.group.restore, slot.group.device)
            slot.group.assert_on_device("SmartSwap.unpack")
        check_version(handle)
        if handle.unit.recorder is not None:
            handle.unit.recorder.unpacked(handle.live, slot)
        self._prefetch_after(handle)
        return handle.tensor

    def _read_in_forward(self, handle: Handle) -> torch.Tensor:
        """A saved tensor read while the model's forward still runs: its data, nothing else.

        Note: [Reads of saved tensors inside the forward]
        ``torch.autograd.grad`` inside a forward (a gradient penalty, a physics loss) and reads
        of ``grad_fn._saved_*`` unpack saved tensors without starting the backward: the forward
        goes on, and what it saves next belongs to the same micro-batch. Such an unpack only
        restores its storage if it had left (it then stays for the step) and checks its version;
        it neither ends the forward's swapping nor counts as a backward read in the profile. An
        unpack while the root module is not running starts the backward.
        """
        slot = handle.slot
        if slot is not None and slot.group is not None and slot.group.stat != DEVICE:
            self._timed(slot.group.restore, slot.group.device)
            slot.group.assert_on_device("SmartSwap.unpack")
        check_version(handle)
        return handle.tensor

    def _start_backward(self) -> None:
        self._complete_inflight()
        unit = self.unit
        unit.backward = True
        unit.pending = []
        if unit.recorder is not None:
            unit.recorder.backward_started()

    def _prefetch_after(self, handle: Handle) -> None:
        unit, slot = handle.unit, handle.slot
        if handle.planned:
            targets = unit.follower.prefetch_targets(handle.index)
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
