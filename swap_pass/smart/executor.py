"""SmartSwap's executor: ``saved_tensors_hooks`` that carry out a policy through the shared runtime.

Per saved tensor (pack)::

    poll: any storage that only our aliases still hold -> SwapTensors(aliases).swap_to_host()
          (+ wait_d2h(): at once on CPU, at the next poll on an accelerator) -> storage freed
    key = (op, module call site, dtype, shape, model state)
    planned step: match key to the policy (window search from a cursor) -> swap or keep (tracked,
          so that a fallback can still move it; see Note: [Falling back mid-step])
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
from swap_pass.runtime.swap_tensors import SwapState, SwapTensors, is_valid_for_swap
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

__all__ = ["ExecMode", "OnlineMatcher", "SmartExecutor", "StepReport", "measure_copy_bandwidth"]

_use_count = torch._C._storage_Use_Count


def _storage_use_count(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


# What a storage held by one tensor reads as: 2 on torch 2.11 and 2.13 (the Python storage object
# made by untyped_storage() counts), 1 on torch 2.6. Measured once, so "nobody but our aliases"
# holds on every release; taking 2.13's figure on 2.6 freed storages still in use (segfault).
_ONE_HOLDER = _storage_use_count(torch.empty(1))


class ExecMode(str, enum.Enum):
    """How the executor decides per saved tensor."""

    CONSERVATIVE = "conservative"  # swap every eligible activation (warmup)
    DETAILED = "detailed"  # conservative + record a DetailedProfile (gen_policy)
    PLANNED = "planned"  # follow a SwapPolicy (stable)


@dataclasses.dataclass
class StepReport:
    """What one step did.

    Attributes:
        keys: Feature keys in forward order (the lightweight profile).
        signature: Hash of ``keys``.
        mode: Executor mode the step began in.
        fell_back: A planned step switched to conservative after too many unmatched tensors.
        matched: Saved tensors matched to policy entries.
        unmatched: Saved tensors not matched (kept on the device).
        swapped_storages: Storages moved to the host.
        swapped_bytes: Their bytes.
        sync_restores: Unpacks that found their data still off the device (a stall).
        profile: The detailed profile (``DETAILED`` steps only).
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

    __slots__ = ("aliases", "group", "swap", "ordinal", "order", "__weakref__")

    def __init__(self, swap: bool, ordinal: int) -> None:
        self.aliases: list[torch.Tensor] = []
        self.group: SwapTensors | None = None
        self.swap = swap
        self.ordinal = ordinal
        self.order = -1

    def releasable(self) -> bool:
        """True when nothing but our aliases holds the storage (see Note: [When a saved tensor may leave])."""
        return _storage_use_count(self.aliases[0]) - (_ONE_HOLDER - 1) == len(self.aliases)


class _Handle:
    """What autograd keeps for a saved tensor we track."""

    __slots__ = ("slot", "tensor", "index", "planned", "version")

    def __init__(self, slot: _Slot | None, tensor: torch.Tensor, index: int, planned: bool = False) -> None:
        self.slot, self.tensor, self.index, self.planned = slot, tensor, index, planned
        self.version = tensor._version


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``t``'s storage that shares its version counter but not its lifetime."""
    return t.detach()


def _check_version(handle: _Handle) -> None:
    # Note: autograd skips its own version check for tensors saved through hooks; the alias
    # shares the saved tensor's version counter, so an in-place write is still caught here.
    if handle.tensor._version != handle.version:
        t = handle.tensor
        raise RuntimeError(
            f"swap_pass.SmartSwap: a tensor saved for backward (shape {tuple(t.shape)}, {t.dtype}) "
            f"was modified by an inplace operation after it was saved (version {handle.version} -> "
            f"{t._version}). A saved tensor must not be written before backward; clone it first."
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


class SmartExecutor:
    """Pack/unpack hooks for one model; one instance lives as long as its :class:`SmartSwap`.

    Args:
        swap_config: Runtime knobs for the :class:`SwapTensors` groups (host caps, streams).
        min_swap_bytes: Storages below this are never moved.
        match_window: :class:`OnlineMatcher` window.
        miss_limit: Consecutive unmatched tensors after which a planned step turns conservative.
        conservative_prefetch: In conservative steps, storages (in reverse release order)
            brought back ahead of the one being read.
    """

    def __init__(self, swap_config: SwapConfig, *, min_swap_bytes: int, match_window: int,
                 miss_limit: int, conservative_prefetch: int = 1) -> None:
        self.swap_config = swap_config
        self.min_swap_bytes = min_swap_bytes
        self.match_window = match_window
        self.miss_limit = miss_limit
        self.conservative_prefetch = conservative_prefetch
        self.state_ptrs: set[int] = set()
        self.fqn = lambda: ""
        self.begin_step(ExecMode.CONSERVATIVE, None)

    # --- step boundaries ----------------------------------------------------------------------

    def begin_step(self, mode: ExecMode, policy: SwapPolicy | None) -> None:
        """Start a step in ``mode`` (``policy`` is required for ``PLANNED``)."""
        if mode == ExecMode.PLANNED and policy is None:
            raise ValueError("swap_pass.SmartSwap: a planned step got no policy. It must have one.")
        self.mode, self.policy = mode, policy
        self.matcher = OnlineMatcher(policy.keys, self.match_window) if policy else None
        self.report = StepReport(keys=[], signature=0, mode=mode)
        self.profile = DetailedProfile() if mode == ExecMode.DETAILED else None
        self.tick = 0
        self.backward = False
        self._slots: dict[int, weakref.ref] = {}  # storage _cdata -> slot
        self._by_index: dict[int, weakref.ref] = {}  # policy entry index -> slot
        self._pending: list[weakref.ref] = []  # slots waiting for their last holder to let go
        self._inflight: list[_Slot] = []  # swap_to_host issued, wait_d2h not yet (accelerators)
        self._released: list[weakref.ref] = []  # swapped slots in release order
        self._kept: list[weakref.ref] = []  # tracked slots a planned step keeps on the device
        self._t_transfer = 0.0
        self._n_storages = 0
        self._miss_streak = 0

    def end_step(self, step_s: float) -> StepReport:
        """Finish the step: complete copies, close the profile, return the :class:`StepReport`."""
        self._complete_inflight()
        rep = self.report
        rep.signature = hash(tuple(rep.keys))
        if self.profile is not None:
            self.profile.end_tick = self.tick
            self.profile.step_s = step_s
            self.profile.transfer_s = self._t_transfer
            rep.profile = self.profile
        return rep

    # --- forward ------------------------------------------------------------------------------

    def poll(self) -> None:
        """Swap out every pending storage nobody but us holds (called at packs and module exits)."""
        self.tick += 1
        self._complete_inflight()
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
        if self.backward:  # saved during backward (double backward, recompute): leave it
            return t
        storage = t.untyped_storage()
        is_state = storage.data_ptr() in self.state_ptrs
        op, fqn = op_name(t), self.fqn()
        key = feature_key(op, fqn, t.dtype, t.shape, state_key(t, storage, self.state_ptrs))
        index = len(self.report.keys)
        self.report.keys.append(key)
        if self.mode == ExecMode.PLANNED:
            return self._pack_planned(t, storage, key, is_state)
        handle = t
        if not is_state and is_valid_for_swap(t):
            handle = self._track(t, storage, storage.nbytes() >= max(self.min_swap_bytes, 1), index)
        elif self.profile is not None:
            handle = _Handle(None, t, index)
        if self.profile is not None:
            self._record(t, storage, op, fqn, key, index, handle.slot)
        return handle

    def _pack_planned(self, t, storage, key, is_state):
        j = self.matcher.match(key)
        if not is_state:  # model state matches whatever the activations do: it proves nothing
            self._miss_streak = 0 if j is not None else self._miss_streak + 1
        if j is None:
            self.report.unmatched += 1
            if self._miss_streak >= self.miss_limit:
                self._fall_back()
        else:
            self.report.matched += 1
        untracked = t if j is None else _Handle(None, t, j, planned=True)
        if is_state or not is_valid_for_swap(t):
            return untracked
        big = storage.nbytes() >= max(self.min_swap_bytes, 1)
        if j is None:  # after a fallback (maybe this very miss) it is swapped like any other
            swap = big and self.mode == ExecMode.CONSERVATIVE
        else:
            swap = self.policy.entries[j].swap
        if not (swap or big):  # never worth moving: not worth tracking either
            return untracked
        index = j if j is not None else len(self.report.keys) - 1
        return self._track(t, storage, swap, index, planned=j is not None)

    def _fall_back(self) -> None:
        """Turn conservative for the rest of the step, and swap what the plan kept so far.

        Note: [Falling back mid-step]
        A planned step whose sequence changed keeps what the old plan kept (and every unmatched
        tensor) until ``miss_limit`` misses in a row. Those tensors are tracked, not swapped;
        here they become swappable and go back to the pending list, so they leave as soon as
        nothing but autograd holds them, exactly as in a conservative step. Without this the
        change step kept them all and passed the budget (by 21% on the CPU model, 12 -> 24
        tokens); see tests/smart/test_smart_swap.py.
        """
        self.mode, self.report.fell_back = ExecMode.CONSERVATIVE, True
        for ref in self._kept:
            slot = ref()
            if slot is not None:
                slot.swap = True
        self._pending += self._kept  # poll() skips slots already moved
        self._kept = []

    def _track(self, t: torch.Tensor, storage, swap: bool, index: int, planned: bool = False) -> _Handle:
        ref = self._slots.get(storage._cdata)
        slot = ref() if ref is not None else None
        if slot is None or slot.group is not None:
            slot = self._new_slot(storage, swap)
        slot.swap = slot.swap or swap
        alias = _alias(t)
        slot.aliases.append(alias)
        if planned:
            self._by_index[index] = weakref.ref(slot)
        if self.mode == ExecMode.PLANNED and not slot.swap:
            self._kept.append(weakref.ref(slot))
        return _Handle(slot, alias, index, planned)

    def _new_slot(self, storage, swap: bool) -> _Slot:
        slot = _Slot(swap, self._n_storages)
        self._n_storages += 1
        self._slots[storage._cdata] = weakref.ref(slot)
        self._pending.append(weakref.ref(slot))
        if self.profile is not None:
            self.profile.storages.append(StorageLife(nbytes=storage.nbytes(), packed=self.tick))
            weakref.finalize(slot, self._on_drop, self.profile, slot.ordinal)
        return slot

    def _record(self, t, storage, op, fqn, key, index, slot) -> None:
        ordinal = slot.ordinal if slot is not None else -1
        self.profile.records.append(SavedRecord(
            index=index, op=op, fqn=fqn, dtype=t.dtype, shape=tuple(t.shape),
            nbytes=storage.nbytes(), key=key, storage=ordinal))
        if slot is not None:
            self.profile.storages[ordinal].entries.append(index)

    def _on_drop(self, profile: DetailedProfile, ordinal: int) -> None:
        self.tick += 1
        if profile.storages[ordinal].dropped is None:
            profile.storages[ordinal].dropped = self.tick

    def _release(self, slot: _Slot) -> None:
        if not slot.swap:
            self._mark_off(slot)
            return
        t0 = now()
        group = SwapTensors(slot.aliases, config=self.swap_config, name=f"smart#{slot.ordinal}")
        slot.group = group
        group.swap_to_host()
        if group.device is not None and is_async_device(group.device):
            self._inflight.append(slot)  # freed at the next poll, so the copy overlaps compute
        else:
            group.wait_d2h()
            self._mark_off(slot)
        self._t_transfer += now() - t0
        slot.order = len(self._released)
        self._released.append(weakref.ref(slot))
        self.report.swapped_storages += 1
        self.report.swapped_bytes += group.nbytes

    def _mark_off(self, slot: _Slot) -> None:
        """Profile: from this tick the storage could be (or is) off the device."""
        if self.profile is not None:
            self.profile.storages[slot.ordinal].released = self.tick

    def _complete_inflight(self) -> None:
        for slot in self._inflight:
            if slot.group.stat == SwapState.D2H:
                slot.group.wait_d2h()
                self._mark_off(slot)
        self._inflight.clear()

    # --- backward -----------------------------------------------------------------------------

    def unpack(self, handle):
        """The unpack hook: data back on the device before anyone reads it, then prefetch."""
        if type(handle) is not _Handle:
            return handle
        if not self.backward:
            self._start_backward()
        self.tick += 1
        slot = handle.slot
        if slot is not None and slot.group is not None:
            if slot.group.stat != SwapState.DEVICE:
                self.report.sync_restores += slot.group.stat != SwapState.H2D
                self._timed(slot.group.restore)
            slot.group.assert_on_device("SmartSwap.unpack")
        _check_version(handle)
        if self.profile is not None:
            self._record_unpack(handle)
        self._prefetch_after(handle)
        return handle.tensor

    def _start_backward(self) -> None:
        self._complete_inflight()
        self.backward = True
        self._pending = []
        if self.profile is not None:
            self.profile.backward_tick = self.tick + 1

    def _record_unpack(self, handle: _Handle) -> None:
        self.profile.unpack_ticks.append((self.tick, handle.index))
        rec = self.profile.records[handle.index]
        if rec.bwd_order < 0:
            rec.bwd_order = len(self.profile.unpack_ticks) - 1
        if handle.slot is not None and self.profile.storages[handle.slot.ordinal].unpacked is None:
            self.profile.storages[handle.slot.ordinal].unpacked = self.tick

    def _prefetch_after(self, handle: _Handle) -> None:
        if handle.planned:
            targets = (self._by_index.get(j) for j in self.policy.prefetch.get(handle.index, ()))
        elif handle.slot is not None and handle.slot.order >= 0 and self.conservative_prefetch:
            lo = max(handle.slot.order - self.conservative_prefetch, 0)
            targets = iter(self._released[lo:handle.slot.order])
        else:
            return
        for ref in targets:
            slot = ref() if ref is not None else None
            if slot is not None and slot.group is not None and slot.group.stat == SwapState.HOST:
                self._timed(slot.group.swap_to_device)

    def _timed(self, fn) -> None:
        t0 = now()
        fn()
        self._t_transfer += now() - t0
