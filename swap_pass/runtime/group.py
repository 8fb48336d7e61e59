"""One group of tensors (one layer's input, one micro-batch) moved between device and host.

State machine (MindSpeed's, enforced)::

    "device" --swap_to_host()--> "d2h" --wait_d2h()--> "host"
        ^                                                 |
        +------- wait_h2d() <-- "h2d" <--swap_to_device()-+

Swapping works on storages: each distinct untyped storage is copied whole into a flat host
buffer and freed in place (``resize_(0)``); restoring resizes it back and copies the bytes in, so
every tensor sharing it (saved references, views, slices) sees its data again.

Stream protocol: events order the streams; ``record_stream`` covers only what they cannot, a
storage allocated on another stream (Note: [Frees on the allocating stream] in ``device.py``):

* ``swap_to_host``: the d2h stream waits on an event recorded on the compute stream, copies,
  records ``e_d2h``; each storage the copy reads records the d2h stream.
* ``wait_d2h``: the compute stream waits on ``e_d2h``, then the storage is freed: the caching
  allocator (its allocating stream's pool, whichever) keeps it until the d2h stream ran the copy.
* ``swap_to_device``: the storage is re-allocated on the compute stream; the h2d stream waits on
  an event recorded after that, copies, records ``e_h2d``. The tensors stay guarded until the
  compute stream waits on ``e_h2d`` (a Python reader completes the restore first: Note:
  [Guarding freed tensors]).
* ``wait_h2d``: the compute stream waits on ``e_h2d``, the tensors are unguarded and the host
  buffer is pooled again (later d2h copies follow this wait through the compute stream).
"""

from __future__ import annotations

import enum
import operator
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from swap_pass.config import OnHostExhausted, SwapConfig, check_config
from swap_pass.runtime import stats
from swap_pass.runtime.device import (
    DeviceStreams,
    _free_checks,
    device_streams,
)
from swap_pass.runtime.errors import HostMemoryError, SwapDataError, SwapStateError
from swap_pass.runtime.freeing import give_up, guard_freed, unguard
from swap_pass.runtime.host_pool import host_pool
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.runtime.storages import (
    StorageEntry,
    group_by_storage,
    keep_non_resizable,
    one_entry,
    queue_copies,
    record_after,
)
from swap_pass.state import kept_on_host as _kept_on_host
from swap_pass.state import owners as _owners
from swap_pass.state import owners_lock as _lock
from swap_pass.state import warn_once

__all__ = ["SwapState", "SwapTensors", "claim_storage", "clear_owners", "discard_groups_off_device",
           "is_valid_for_swap", "kept_groups", "live_groups", "no_group",
           "release_storages", "restore_or_keep", "retry_kept_groups", "storage_key"]


# --- Which live swap group holds each storage: a storage is in at most one ------------------------
# Note: [One storage, one live group]
# A layer that returns its input, or one tensor fed to two layers, puts one storage into two
# groups: the first ``wait_d2h`` would free it while the second group's copy still reads it, and
# the first restore would write it back under the second group's feet. So a group claims its
# storages when its copy out starts, and a storage claimed by a group still in ``"d2h"`` moves to
# the newer group; the older one drops it and gives its host buffer back with its copy's event
# (Note: [A released buffer carries its last copy's event]). Backward restores the newer group
# first (layers run in reverse), so every reader finds the data back in time. A storage already
# freed by another group is never claimed (its tensors are not valid for a swap). Groups give
# their storages up when their data is back on the device.


class _Group(Protocol):
    def drop_storage(self, key: int) -> None: ...


_acquire, _release = _lock.acquire, _lock.release  # cheaper than ``with`` (see runtime/stats.py)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage (its ``StorageImpl``), stable across resizes."""
    return storage._cdata


def claim_storage(group: _Group, key: int) -> None:
    """Make ``group`` the one live holder of the storage ``key`` (its :func:`storage_key`); an
    older holder drops it."""
    new = weakref.ref(group)
    _acquire()
    try:
        ref = _owners.get(key)
        _owners[key] = new
    finally:
        _release()
    previous = ref() if ref is not None else None
    if previous is not None and previous is not group:
        previous.drop_storage(key)


def release_storages(group: _Group, keys: Iterable[int]) -> None:
    """Forget ``group`` as holder of the storages ``keys`` (its data is back, or it dropped)."""
    _acquire()
    try:
        for key in keys:
            ref = _owners.get(key)
            if ref is not None:
                held = ref()
                if held is group or held is None:
                    del _owners[key]
    finally:
        _release()


def live_groups() -> list[_Group]:
    """The live groups, each once, in no particular order."""
    with _lock:
        refs = list(_owners.values())
    found: dict[int, _Group] = {}
    for ref in refs:
        group = ref()
        if group is not None:
            found[id(group)] = group
    return list(found.values())


def clear_owners() -> None:
    """Forget every holder (:func:`swap_pass.reset`)."""
    with _lock:
        _owners.clear()


# --------------------------------------------------------------------------------------------------


_DEFAULT_CONFIG = SwapConfig()
_POOL = host_pool()  # process-wide, never replaced: read once instead of a call per transition


class SwapState(str, enum.Enum):
    """Where a :class:`SwapTensors` group's data is. Compares equal to its string value."""

    DEVICE = "device"
    D2H = "d2h"
    HOST = "host"
    H2D = "h2d"

    def __str__(self) -> str:
        return self.value


# Globals for the transitions' per-call compares: ``SwapState.X`` goes through the enum metaclass.
DEVICE, D2H, HOST, H2D = SwapState.DEVICE, SwapState.D2H, SwapState.HOST, SwapState.H2D
_version = operator.attrgetter("_version")  # map() over it: no comprehension frame per swap


def no_group() -> None:
    """A dead link to a group: what :attr:`SwapTensors.previous_link` is until it is set."""
    return None


def _is_view_of_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base
    while base is not None:
        if isinstance(base, torch.nn.Parameter):
            return True
        base = base._base
    return False


def is_valid_for_swap(tensor: object,
                      custom_check_fn: Callable[[torch.Tensor], bool] | None = None) -> bool:
    """Whether ``tensor`` may be swapped.

    False for non-tensors, ``nn.Parameter`` and views of one, tensors whose storage is empty
    (already freed, or zero bytes), meta, sparse and nested tensors (their data is not one
    storage's bytes). Otherwise ``custom_check_fn(tensor)`` decides when given.
    """
    # type() first: it rules out non-tensors, Parameters and subclasses (a guarded tensor). A
    # plain tensor marked ``_is_param`` is an instance of Parameter too.
    if type(tensor) is not torch.Tensor or getattr(tensor, "_is_param", False):
        return False
    if tensor._base is not None and _is_view_of_parameter(tensor):
        return False
    if tensor.is_meta or tensor.layout != torch.strided or tensor.is_nested:
        return False
    if tensor.untyped_storage().nbytes() == 0:
        return False
    return True if custom_check_fn is None else bool(custom_check_fn(tensor))


# Note: [Few objects per group]
# A layer-input group lives from its layer's forward to its backward, so each container it makes
# is walked by every young-generation collection and promoted; the more objects reach the old
# generation, the sooner a full collection (100 ms and more with torch imported) comes. So a
# group of one tensor keeps one list of it (shared by the group, its entry and its freed tensors;
# a manager's claim hands its list over), versions and storage keys are tuples of ints (untracked
# by the collector), and freed tensors carry no attribute (see ``freeing.py``). Measured with
# ``scripts/host_cost.py gc``, 32 layers, 1500 steps: a dict and a tuple per freed tensor brought
# a full collection every 300 steps against 500 without a swap (collector 18.5 against 10.5 us per
# layer per step); without them, every 500 (13.3 against 11.1 us). At 64 layers (800 steps): every
# 80 steps against 200 (28.5 against 12.3 us), as the group, its entry and its guard still live
# through the forward.


# Note: [The compute stream of a swap]
# A group's storages are produced on one stream, allocated from its pool and read there: the
# group's compute stream. It is read once, when the swap begins (or given by a caller who knows
# the producer), and every later step orders on it: the wait for the copy out before a free, the
# re-allocation for the copy back, the wait for the copy back before the first reader. Never the
# stream current at that later moment: a finalizer (a group or graph dropped by the cyclic
# collector) can run inside the runtime's own ``with side_stream:``, and a caller may be inside a
# stream context of its own. A wait on the wrong stream lets the allocator hand out a freed block
# while the copy still reads it, or a reader see a copy back's destination before it is written.


# Note: [All-or-nothing transitions]
# Any storage of a group can fail a transition (a host buffer that cannot be pinned, a copy that
# raises, a storage the device cannot resize). The transition then undoes what it did, leaves the
# group in its starting state with every tensor's data in place (from "host": still on the host,
# guarded) and lets the error propagate. A freed storage is never left without its host copy.


class SwapTensors:
    """A group of tensors swapped together between device and host.

    Args:
        tensors: The tensors to swap. Invalid ones (see :func:`is_valid_for_swap`) are left out,
            and tensors sharing a storage are swapped once. All must be on one device.
        custom_check_fn: Extra predicate passed to :func:`is_valid_for_swap`. Default: ``None``.
        config: Runtime knobs. Default: ``SwapConfig()``.
        name: Shown in errors, e.g. the layer's name. Default: ``None``.
        copy_span: Copy and restore only the bytes each storage's tensors span, for storages
            nobody else holds (Note: [Ownership rule] in ``swap_pass/runtime/freeing.py``); the
            rest reads as garbage after the restore. Default: ``False`` (whole storages).
        checked: The tensors passed :func:`is_valid_for_swap` and ``config`` is validated (a
            manager's claim at the layer's entry); only storages freed since are left out. The
            list is handed over: the group keeps it as :attr:`tensors`. Default: ``False``.
        compute_stream: The stream the tensors were produced on and are read on: every wait
            and re-allocation of the swap is ordered on it. Default: ``None`` (the stream
            current when the swap begins; see Note: [The compute stream of a swap]).

    Attributes:
        stat: ``"device"``, ``"d2h"``, ``"host"`` or ``"h2d"``.
        tensors: The tensors the group swaps.
        kept_on_device: True when the group's data never left the device: host memory ran out
            under ``on_host_exhausted="keep_on_device"``, or a stream was capturing a graph.
        guarded: Set by the layer protocol that drives the group (``swap_pass/eager``): a
            backward guard protects it, so it may be freed. Default: ``False``.
        previous_link: Set by the same protocol: a weak reference to the previous layer's group
            of the same micro-batch. Default: a dead link (calling it returns None).
        entry_mark: Set by the protocol that drives the group: autograd's sequence number at
            its layer's entry (:func:`swap_pass.runtime.freeing.autograd_mark`), which bounds
            the ownership check at free time. Default: ``0``.
    """

    # Made per swapped layer per step: slots (``__dict__`` only for attributes a caller adds).
    __slots__ = ("config", "tensors", "name", "device", "stat", "kept_on_device", "guarded",
                 "previous_link", "entry_mark", "_entries", "_nbytes", "_host_nbytes",
                 "_entry_tensors", "_keys", "_ds", "_pinned", "_compute", "_event", "_out_waited",
                 "__dict__", "__weakref__")

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        *,
        custom_check_fn: Callable[[torch.Tensor], bool] | None = None,
        config: SwapConfig | None = None,
        name: str | None = None,
        copy_span: bool = False,
        checked: bool = False,
        compute_stream: torch.Stream | None = None,
    ) -> None:
        if checked:  # handed over: see Note: [Few objects per group]
            self.config = config or _DEFAULT_CONFIG
            self.tensors = tensors if type(tensors) is list else list(tensors)
        else:
            self.config = _DEFAULT_CONFIG if config is None else check_config(config, "SwapTensors")
            self.tensors = [t for t in tensors if is_valid_for_swap(t, custom_check_fn)]
        self.name = name
        tensors, min_bytes = self.tensors, self.config.min_swap_bytes
        if len(tensors) == 1:  # a layer input
            self._entries = one_entry(tensors, min_bytes, copy_span)
        else:
            self._entries = group_by_storage(tensors, min_bytes, copy_span)
        if not all(e.storage.resizable() and e.storage.device.type not in _free_checks
                   for e in self._entries):
            self._entries = keep_non_resizable(self._entries, name)
        self._take_stock()
        entries = self._entries
        if len(entries) == 1:  # the common case: one layer input
            self.device = entries[0].storage.device
        else:
            devices = {e.storage.device for e in entries}
            if len(devices) > 1:
                raise ValueError(
                    f"swap_pass.SwapTensors: tensors of {self.name or 'one group'} are on several "
                    f"devices ({sorted(str(d) for d in devices)}). A group must be on one device."
                )
            self.device = next(iter(devices), None)
        self._ds: DeviceStreams | None = None  # looked up once: every transition needs it
        self._pinned: bool | None = None
        self._compute = compute_stream  # None: the current stream when the swap begins
        self.stat = DEVICE
        self.kept_on_device = False
        self.guarded = False
        self.previous_link: Callable[[], SwapTensors | None] = no_group
        self.entry_mark = 0
        self._event = None
        self._out_waited = False  # the compute stream waited for the copy out: wait_copy_out()

    def __repr__(self) -> str:
        return (f"SwapTensors(name={self.name!r}, stat={self.stat.value!r}, "
                f"storages={len(self._entries)}, nbytes={self.nbytes})")

    @property
    def nbytes(self) -> int:
        """Bytes of all distinct storages in the group."""
        return self._nbytes

    @property
    def host_nbytes(self) -> int:
        """Bytes copied to the host: whole storages, or their spans under ``copy_span``."""
        return self._host_nbytes

    def _take_stock(self) -> None:
        """Cache the entries' sizes, tensors (freed and guarded) and keys for the transitions."""
        entries = self._entries
        if len(entries) == 1:  # one layer input
            e = entries[0]
            self._nbytes, self._host_nbytes = e.nbytes, e.host_nbytes
            self._entry_tensors, self._keys = e.tensors, (e.key,)
            return
        self._nbytes = sum(e.nbytes for e in entries)
        self._host_nbytes = sum(e.host_nbytes for e in entries)
        self._entry_tensors = [t for e in entries for t in e.tensors]
        self._keys = tuple(e.key for e in entries)

    @property
    def is_empty(self) -> bool:
        """True when nothing in the group would be moved."""
        return not self._entries

    # --- the four transitions -----------------------------------------------------------------

    def swap_to_host(self, stream: torch.Stream | None = None) -> None:
        """Start copying the group's storages to host buffers (state "device" -> "d2h").

        All or nothing: if a host buffer or a copy fails, the group is back in "device" and the
        error propagates. While the compute stream captures a graph (CUDA graphs), nothing is
        copied: the data stays, counted as ``swap_stats().skipped_bytes["stream_capture"]``.
        """
        if self.stat is not DEVICE:  # checked inline: every transition passes here
            self._expect(DEVICE, "SwapTensors.swap_to_host")
        entries = self._entries
        for e in entries:  # see Note: [One storage, one live group]
            e.versions = tuple(map(_version, e.tensors))
            claim_storage(self, e.key)
        if entries:
            ds = self._ds or self._streams()
            if ds.is_async and ds.is_capturing(self._compute):
                self._keep_while_capturing()
            else:
                self._start_copy_out(ds, stream)
        self.stat = D2H

    def _start_copy_out(self, ds: DeviceStreams, stream: torch.Stream | None) -> None:
        """Take the host buffers and queue the copies out; undo both on any failure."""
        if stream is None and ds.is_async:  # None: copies are synchronous (CPU)
            stream = ds.d2h_stream(self._compute)
        try:
            if not self._acquire_host_buffers():
                self.kept_on_device = True
                return
            self._event = queue_copies(ds, stream, self._entries, to_host=True,
                                        pinned=self._pinned, compute=self._compute)
        except BaseException:
            self._undo_copy_out(ds, stream)
            raise
        stats.record_swap_out(self._host_nbytes)

    def _undo_copy_out(self, ds: DeviceStreams, stream: torch.Stream | None) -> None:
        """A failed :meth:`swap_to_host`: the compute stream (the storages' allocating stream)
        and the buffers' next taker wait for the copies queued so far; back in "device"."""
        event = record_after(ds, stream)
        self._wait_on_compute(event)
        self._release_host_buffers(event)
        self._event = None
        self._leave_registry()

    def _keep_while_capturing(self) -> None:
        """The compute stream is capturing a graph: copies and frees would be captured and
        replayed later into host buffers the pool has handed out again. Keep the data."""
        self.kept_on_device = True
        record_skip(SkipReason.STREAM_CAPTURE, self._nbytes, where=self.name,
                    detail="Swaps never run while a stream captures a CUDA graph; swap outside "
                           "the captured region, or capture without swap_pass.")

    # Note: [A group that meets a capture]
    # A group begun before a capture (CUDA graphs, NPU graphs) can reach its next transition inside
    # it (a layer's backward captured after its forward ran eagerly, a reader restoring a guarded
    # tensor). Each transition would queue captured work: a wait on an event recorded outside the
    # capture, a free, a re-allocation, a copy from a host buffer that a replay would read again
    # after the pool handed it out. None runs. ``wait_d2h`` keeps the data on the device (the
    # storages are whole; the copy out needs no wait, as the copy stream is recorded on them: Note:
    # [Frees on the allocating stream] in ``device.py``) and the group goes on as kept
    # (``skipped_bytes["stream_capture"]``). ``swap_to_device`` and ``wait_h2d`` cannot keep
    # anything (the data is on the host or on its way back), so they refuse before doing anything:
    # the group stays as it was, tensors guarded, and the same call after the capture completes it.

    def _capturing(self, ds: DeviceStreams) -> bool:
        """Whether the group's compute stream (or the current stream) is capturing a graph."""
        return ds.is_async and ds.is_capturing(self._compute)

    def _capture_error(self, api: str, what: str) -> RuntimeError:
        """The refusal of ``api`` inside a capture (see Note: [A group that meets a capture])."""
        return RuntimeError(
            f"swap_pass.SwapTensors.{api}: called while a stream captures a graph (compute "
            f"stream {self._compute}) for {self.name or 'a swap group'} in state "
            f"{self.stat.value!r}; {what}. A group begun outside a capture must be completed "
            "outside it: call it before the capture begins or after it ends (the group is "
            "unchanged, its tensors stay guarded).")

    def _keep_copied_while_capturing(self) -> None:
        """:meth:`wait_d2h` inside a capture: keep the device data, give the host buffers back
        with the copy's event (their next taker waits on it), and go on as kept."""
        self._release_host_buffers(self._event)
        self._event, self._out_waited = None, False
        self._keep_while_capturing()

    def wait_d2h(self) -> None:
        """Wait for the device-to-host copy, then free the device storages ("d2h" -> "host").

        All or nothing: if a free fails, the storages freed before it are refilled from the host
        copy, the group is back in "device" and the error propagates.
        """
        if self.stat is not D2H:  # checked inline: every transition passes here
            self._expect(D2H, "SwapTensors.wait_d2h")
        entries = self._entries
        for e in entries:  # nothing written since swap_to_host()
            for t, v in zip(e.tensors, e.versions, strict=True):
                if t._version != v:
                    raise _modified_error(self.name, t, v, "between swap_to_host() and wait_d2h()")
        if not self.kept_on_device and entries:
            ds = self._ds or self._streams()
            if self._capturing(ds):  # see Note: [A group that meets a capture]
                self._keep_copied_while_capturing()
                self.stat = HOST
                return
            if not self._out_waited:
                self._wait_on_compute(self._event)
            self._out_waited = False  # _event kept: the host buffers' last copy (discard)
            self._free_all(ds, entries)
            guard_freed(self._entry_tensors, self)
            stats.record_released(self._nbytes)
        self.stat = HOST

    def _free_all(self, ds: DeviceStreams, entries: list[StorageEntry]) -> None:
        """Free every entry's storage, or none: on a failure, the ones freed are restored."""
        freed: list[StorageEntry] = []
        try:
            for e in entries:
                if e.dense:  # see Note: [Dense copies]
                    e.alias = e.tensors[0].data
                ds.free_storage(e.storage)
                freed.append(e)
        except BaseException as err:
            self._roll_back_frees(ds, freed)
            _add_note(err, f"swap_pass.SwapTensors.wait_d2h: freeing a storage of "
                           f"{self.name or 'a swap group'} failed; every tensor of the group "
                           "keeps its data on the device.")
            raise

    def _roll_back_frees(self, ds: DeviceStreams, freed: list[StorageEntry]) -> None:
        """Give ``freed`` their bytes back from the host copies, on the compute stream (which
        waited for the copies out), and end in "device" with the buffers given back."""
        compute = self._compute
        for e in freed:
            ds.allocate_storage(e.storage, e.nbytes, compute)
        event = queue_copies(ds, compute, freed, to_host=False, pinned=self._pinned,
                              compute=compute) if freed else self._event
        self._release_host_buffers(event)
        self._event, self._out_waited = None, False
        self._leave_registry()
        self.stat = DEVICE

    def wait_copy_out(self) -> None:
        """Make the compute stream wait for the device-to-host copy; the state stays "d2h".

        For an ownership check before :meth:`wait_d2h` (the copy's source holds the storage
        until the copy ran), which then waits no more. The event stays for an abandon from "d2h".
        """
        if self.stat is not D2H:
            self._expect(D2H, "SwapTensors.wait_copy_out")
        if (not self._out_waited and self._event is not None
                and not self._capturing(self._ds or self._streams())):  # then wait_d2h keeps
            self._wait_on_compute(self._event)
            self._out_waited = True

    def swap_to_device(self, stream: torch.Stream | None = None) -> None:
        """Re-allocate the device storages and start copying the data back ("host" -> "h2d").

        All or nothing: if an allocation or a copy fails, the group stays in "host", tensors
        guarded, and the error propagates; a later restore tries again.
        """
        if self.stat is not HOST:  # checked inline: every transition passes here
            self._expect(HOST, "SwapTensors.swap_to_device")
        entries = self._entries
        if not self.kept_on_device and entries:
            ds = self._ds or self._streams()
            if self._capturing(ds):  # see Note: [A group that meets a capture]
                raise self._capture_error(
                    "swap_to_device", "re-allocating its storages and copying its data back "
                    "would be captured, and a replay would read host buffers handed out since")
            if stream is None and ds.is_async:  # None: copies are synchronous (CPU)
                stream = ds.h2d_stream(self._compute)
            allocated: list[StorageEntry] = []
            try:
                for e in entries:  # on the compute stream of the swap, the stream of its readers
                    ds.allocate_storage(e.storage, e.nbytes, self._compute)
                    allocated.append(e)
                self._event = queue_copies(ds, stream, entries, to_host=False,
                                            pinned=self._pinned, compute=self._compute)
            except BaseException:
                self._undo_copy_in(ds, stream, allocated)
                raise
            stats.record_swap_in(self._host_nbytes, self._nbytes)
        self.stat = H2D

    def _undo_copy_in(self, ds: DeviceStreams, stream: torch.Stream | None,
                      allocated: list[StorageEntry]) -> None:
        """A failed :meth:`swap_to_device`: after the copies queued so far, free what was
        allocated (best effort: the next restore refills any left); the group stays in "host"."""
        self._wait_on_compute(record_after(ds, stream))
        for e in allocated:
            try:
                ds.free_storage(e.storage)
            except Exception:  # noqa: BLE001 - the data is safe on the host either way
                pass

    def wait_h2d(self) -> None:
        """Make the compute stream wait for the data, then release the host buffers
        ("h2d" -> "device")."""
        if self.stat is not H2D:  # checked inline: every transition passes here
            self._expect(H2D, "SwapTensors.wait_h2d")
        entries = self._entries
        if not self.kept_on_device and entries:
            if self._capturing(self._ds or self._streams()):
                raise self._capture_error(  # see Note: [A group that meets a capture]
                    "wait_h2d", "its copy back was queued before the capture, and a captured "
                    "wait cannot order a replay after it")
            event, self._event = self._event, None
            self._wait_on_compute(event)
            unguard(self._entry_tensors)
            self._release_host_buffers(event)  # another device's copy stream waits on it
        self._leave_registry()  # see Note: [One storage, one live group]
        self.kept_on_device = False
        self.stat = DEVICE
        if _kept_on_host:  # a kept group restored by its reader: see restore_or_keep
            _forget_kept(self)

    # --- completing or abandoning a group -----------------------------------------------------

    def restore(self) -> None:
        """Bring the group back to state "device" from any state, data intact. Idempotent."""
        if self.stat is D2H:  # device data is still there: just drop the host copy
            self._abandon_d2h()
        if self.stat is HOST:
            self.swap_to_device()
        if self.stat is H2D:
            self.wait_h2d()

    def discard(self) -> None:
        """Release host buffers without restoring: for groups nobody will read again.

        Freed storages stay freed (reading their tensors raises ``SwapDataError``: Note:
        [Guarding freed tensors]); a group in "d2h" keeps its device data. It ends "device", empty.
        """
        if self.stat == D2H:
            self._abandon_d2h()
        elif self.stat in (HOST, H2D):
            if self.stat == H2D:
                self._wait_on_compute(self._event)
                unguard(self._entry_tensors)
            elif not self.kept_on_device:
                stats.record_released(-self.nbytes)
                give_up(self._entry_tensors, self)  # they stay freed
            self._release_host_buffers(self._event)  # the buffers' last copy
            self._event = None
        self._leave_registry()
        self._entries = []
        self._take_stock()
        self.tensors = []
        self.kept_on_device = False
        self.stat = DEVICE

    def __del__(self) -> None:
        # A group dropped mid-flight (exception, no backward) must not keep its host buffers.
        # No locks here: see Note: [Releasing from __del__] in host_pool.py.
        try:
            for e in self._entries:
                if e.host is not None:
                    break
            else:
                return  # the common case: every buffer went back to the pool
            bufs = [e.host for e in self._entries if e.host is not None]
            if self._event is not None and self._ds is not None and self.stat is not HOST:
                # A copy in flight may use device memory only we hold: the allocating stream
                # waits for it (a stream wait: some backends lack a host synchronize).
                self._wait_on_compute(self._event)
            if self.stat in (HOST, H2D) and not self.kept_on_device:  # nobody restores them now
                give_up(self._entry_tensors, self)
            freed = self.stat == HOST and not self.kept_on_device
            host_pool().release_deferred(  # with the last copy's event: see host_pool.py
                bufs, event=self._event,
                **({"device_bytes_released": -self.nbytes} if freed else {}))
        except Exception:  # interpreter shutdown: the pool may already be gone
            pass

    def restore_for_reader(self, in_backward: bool) -> bool:
        """A guarded tensor of the group is about to be read: restore it if that is safe.

        Data in flight back is always waited for; freed data comes back only inside backward
        (in forward the read is an error). Returns whether the data is back.
        """
        if self.stat == H2D or (in_backward and self.stat == HOST):
            self.restore()
        return self.stat == DEVICE

    def assert_on_device(self, reader: str = "reader") -> None:
        """Raise unless the group's data is on the device and readable (used by every reader)."""
        if self.stat is not DEVICE:
            self._expect(DEVICE, reader)

    # --- internals ----------------------------------------------------------------------------

    def _expect(self, state: SwapState, api: str) -> None:
        if self.stat != state:
            raise SwapStateError(api, self.stat.value, state.value, self.name)

    def _streams(self) -> DeviceStreams:
        """Look up the device's streams, whether our host buffers are pinned (the pool's bucket
        key) and, unless given, the compute stream (Note: [The compute stream of a swap])."""
        if self._ds is None:
            ds = self._ds = device_streams(self.device, self.config.use_streams)
            self._pinned = self.config.pin_memory and ds.pin_memory
            if self._compute is None:
                self._compute = ds.compute_stream()
        return self._ds

    def _wait_on_compute(self, event: object) -> None:
        """Make the swap's compute stream wait for ``event`` (None: a synchronous copy, done)."""
        if event is not None:
            (self._ds or self._streams()).wait(self._compute, event)

    @property
    def compute_stream(self) -> torch.Stream | None:
        """The stream the data is allocated, freed and read on, fixed at swap start (CPU: None)."""
        return self._compute

    def _acquire_host_buffers(self) -> bool:
        """Give each entry a host buffer; False when host memory ran out and policy keeps data."""
        pin, cap = self._pinned, self.config.max_host_bytes
        try:
            for e in self._entries:  # dense: a host buffer shaped like the tensor
                e.host, e.host_event = _POOL.take(e.host_nbytes, pin, cap,
                                                  e.tensors[0] if e.dense else None)
        except HostMemoryError:
            self._release_host_buffers()
            if self.config.on_host_exhausted == OnHostExhausted.ERROR:
                raise
            _warn_keep_on_device(self.name)
            stats.record(kept_on_device=1)
            record_skip(SkipReason.HOST_EXHAUSTED, sum(e.host_nbytes for e in self._entries),
                        warn=False)  # _warn_keep_on_device said it
            return False
        return True

    def _release_host_buffers(self, event: object = None) -> None:
        pinned = self._pinned  # set with the host buffers' streams
        for e in self._entries:
            if e.host is not None:
                _POOL.release(e.host, event, pinned)
                e.host = None
            e.alias = None

    def _leave_registry(self) -> None:
        release_storages(self, self._keys)

    def drop_storage(self, key: int) -> None:
        """A newer group took over a storage of ours (see Note: [One storage, one live group])."""
        if self.stat not in (DEVICE, D2H):
            return  # freed storages are never claimed; nothing to give up
        for idx, e in enumerate(self._entries):
            if e.key == key:
                if e.host is not None:
                    host_pool().release(e.host, self._event)  # our copy may still write it
                del self._entries[idx]
                self._take_stock()
                self.tensors = [t for t in self.tensors if all(t is not u for u in e.tensors)]
                return

    def _abandon_d2h(self) -> None:
        # The copy may still read the device storages, which may be freed or die any time now:
        # the compute stream (their allocating stream) waits for it, except inside a capture,
        # where the copy stream recorded on them keeps them (Note: [A group that meets a
        # capture]). It may still write the buffers: their next taker waits on its event.
        if self._event is not None and not self._capturing(self._ds or self._streams()):
            self._wait_on_compute(self._event)
        self._release_host_buffers(self._event)
        self._event, self._out_waited = None, False
        self._leave_registry()
        self.kept_on_device = False
        self.stat = DEVICE


def _modified_error(name: str | None, t: torch.Tensor, version: int, when: str) -> SwapDataError:
    """The error for a swapped tensor written in place (its version moved on from ``version``)."""
    return SwapDataError(
        f"swap_pass.SwapTensors: a tensor of {name or 'a swap group'} (shape {tuple(t.shape)}, "
        f"{t.dtype}) was modified in place {when} (version {version} -> {t._version}). A swapped "
        "tensor must not be written between swap-out and swap-in; clone it before modifying it."
    )


def _add_note(err: BaseException, note: str) -> None:
    """Say what the runtime did about ``err`` beside it, in its traceback."""
    add = getattr(err, "add_note", None)
    if add is not None:
        add(note)


def discard_groups_off_device(*, restore: bool = False) -> int:
    """Discard (or with ``restore``, restore) every group holding host buffers; return how many.

    A group can outlive its step outside any manager: held by a reference cycle (an exception's
    traceback) until the cyclic collector runs, or made by a user. :func:`swap_pass.reset` calls
    this so that "reset" means no host bytes in use, whenever the collector runs. Host buffers
    are taken after a group claims its storages and given back before it releases them (Note:
    [One storage, one live group]), so only the live groups are looked at.
    """
    groups = [g for g in live_groups() if any(e.host is not None for e in g._entries)]
    for group in groups:
        restore_or_keep(group) if restore else group.discard()
    return len(groups)


# Groups whose restore failed, with the error, wait in state.kept_on_host (see restore_or_keep).

def restore_or_keep(group: SwapTensors) -> BaseException | None:
    """Restore ``group``; when that fails, keep it, its data on the host and its tensors guarded,
    until a later :func:`retry_kept_groups` (each :func:`swap_pass.reset`) or a reader restores
    it. Returns the error, or None. A group is never dropped with its storages freed."""
    try:
        group.restore()
    except Exception as err:  # noqa: BLE001 - kept, reported by the caller
        _forget_kept(group)
        _kept_on_host.append((group, err))
        return err
    return None


def kept_groups() -> list[tuple[SwapTensors, BaseException]]:
    """The groups :func:`restore_or_keep` kept, each with its last error (a copy)."""
    return list(_kept_on_host)


def retry_kept_groups(groups: list[tuple[SwapTensors, BaseException]]) -> None:
    """Try again to restore ``groups`` (from :func:`kept_groups`); those that fail stay kept."""
    for group, _ in groups:
        restore_or_keep(group)


def unrestored_error(failed: list[tuple[SwapTensors, BaseException]], api: str) -> SwapDataError:
    """The error for groups that could not be brought back to the device by ``api``."""
    names = ", ".join(g.name or "a swap group" for g, _ in failed[:4])
    return SwapDataError(
        f"swap_pass.{api}: {len(failed)} swap group(s) could not be brought back to the device "
        f"({names}; first error: {failed[0][1]!r}). Their data stays in host memory and their "
        "tensors stay guarded; the next swap_pass.reset(), or their backward, tries again once "
        "device memory is there."
    )


def _forget_kept(group: SwapTensors) -> None:
    for i, (g, _) in enumerate(_kept_on_host):
        if g is group:
            del _kept_on_host[i]
            return


def _warn_keep_on_device(name: str | None) -> None:
    warn_once(
        "keep_on_device", "",
        f"swap_pass: host memory exhausted while swapping {name or 'a group'}; under "
        "SwapConfig(on_host_exhausted='keep_on_device') such tensors stay on the device. "
        "Training continues with more device memory in use. (Shown once.)",
        stacklevel=4,
    )
