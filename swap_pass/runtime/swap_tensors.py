"""One group of tensors (one layer's input, one micro-batch) moved between device and host.

State machine (MindSpeed's, enforced)::

    "device" --swap_to_host()--> "d2h" --wait_d2h()--> "host"
        ^                                                 |
        +------- wait_h2d() <-- "h2d" <--swap_to_device()-+

Swapping works on storages, not tensors: each distinct untyped storage is copied whole into a
flat host buffer, then freed in place with ``untyped_storage().resize_(0)``; restoring resizes it
back and copies the bytes in. Every tensor that shares the storage (autograd's saved references,
views, slices) therefore sees its data again with its own dtype, strides and offset.

Stream protocol. It orders streams with events, and calls ``record_stream`` only for the one
case events cannot order (a storage allocated on another stream than the compute stream; see
Note: [Frees on the allocating stream] in ``device.py``):

* ``swap_to_host``: the d2h stream waits on an event recorded on the compute stream, copies,
  records ``e_d2h``; each storage the copy reads records the d2h stream.
* ``wait_d2h``: the compute stream waits on ``e_d2h``; only then is the device storage freed, so
  the caching allocator cannot hand it out while the copy still reads it (its allocating
  stream's pool, whatever stream that is, keeps it until the d2h stream ran the copy).
* ``swap_to_device``: the storage is re-allocated on the compute stream, the h2d stream waits on
  an event recorded after that, copies, records ``e_h2d``. The tensors stay guarded: nothing may
  read the storage before the compute stream waits on ``e_h2d`` (a Python reader that tries
  completes the restore first; see Note: [Guarding freed tensors]).
* ``wait_h2d``: the compute stream waits on ``e_h2d`` before any reader, then the tensors are
  unguarded; the host buffer goes back to the pool (later d2h copies are ordered after this wait
  through the compute stream).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import warnings
from collections.abc import Callable, Iterable

import torch

from swap_pass.config import OnHostExhausted, SwapConfig, check_config
from swap_pass.runtime import live_groups, stats
from swap_pass.runtime.device import (
    DeviceStreams,
    _free_checks,
    cannot_free_reason,
    device_streams,
)
from swap_pass.runtime.errors import HostMemoryError, SwapDataError, SwapStateError
from swap_pass.runtime.freed_guard import give_up, guard_freed, unguard
from swap_pass.runtime.host_pool import host_pool
from swap_pass.runtime.ownership import byte_span
from swap_pass.runtime.skips import SkipReason, record_skip

__all__ = [
    "SwapState",
    "SwapTensors",
    "discard_groups_off_device",
    "is_valid_for_swap",
    "kept_groups",
    "no_group",
    "restore_or_keep",
    "retry_kept_groups",
]

_DEFAULT_CONFIG = SwapConfig()
_POOL = host_pool()  # process-wide, never replaced: read once instead of a call per transition
_warned_keep_on_device = False


class SwapState(str, enum.Enum):
    """Where a :class:`SwapTensors` group's data is. Compares equal to its string value."""

    DEVICE = "device"
    D2H = "d2h"
    HOST = "host"
    H2D = "h2d"

    def __str__(self) -> str:
        return self.value


# The states as module constants for the transitions, which compare them at every call: reading
# ``SwapState.DEVICE`` goes through the enum's metaclass, over 10x the cost of a global read
# (76 ns against 6 ns on CPython 3.11, ``python -m timeit``).
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


# Note: [Dense copies]
# The common entry is one contiguous tensor over all of its storage (a layer input). Its host
# buffer is taken from the pool in the tensor's dtype and shape, and the copies run tensor to
# tensor: out from ``t.data``, back into ``alias``, a second ``t.data`` made just before the
# storage is freed (while ``t`` is still a plain tensor, after the ownership check counted the
# storage's holders) and dropped with the host buffer. Both are plain detached tensors over the
# storage, so neither records autograd history nor bumps ``t``'s version counter, and neither
# passes the freed tensor's guard. A storage-to-storage copy (every other whole storage) builds a
# byte view of each side inside the copy; the two dense copies cost the host several microseconds
# less per layer (measured on the bench's bare copy-and-free reference, 2 CPU cores, torch
# 2.13: 30.2 us per layer with storage copies, 21.7 us with tensor copies).


# Note: [Few objects per group]
# A layer-input group lives from its layer's forward to its backward, so every container it
# makes is one more object that each collection of the young generations walks and moves on to
# the old one, and the more objects reach it, the sooner the collector walks the whole heap
# (a hundred milliseconds and more once torch is imported). So a group of one tensor keeps one
# list of it (the group's, its entry's and its freed tensors' are the same list, and a manager's
# claim hands its list over); its versions and storage keys are tuples of ints, which the
# collector stops tracking; and the freed tensors carry no attribute (see ``freed_guard.py``).
# ``scripts/host_cost.py gc`` (32 layers, 1500 steps): with a dict and a tuple on each freed
# tensor, a full collection came every 300 steps of the eager swap against every 500 without a
# swap, and the collector took 18.5 us per layer per step against 10.5; without them, every 500
# steps and 13.3 us against 11.1. With 64 layers (800 steps) the eager swap still brings a full
# collection every 80 steps against 200, at 28.5 us against 12.3: the group, its entry and its
# guard still live through the forward.


# Note: [The compute stream of a swap]
# A group's storages are produced on one stream, their blocks belong to the pool of the stream
# that allocated them, and their readers run there: that is the group's compute stream. It is
# read once, when the swap begins (or given by the caller who knows the producer), and every
# later step orders on it: the compute stream's wait for the copy out before a free, the
# re-allocation for the copy back, the wait for the copy back before the first reader. Never
# the stream current at that later moment: a finalizer (a group or a graph dropped by the cyclic
# collector) can run inside the runtime's own ``with side_stream:`` during a copy, and a caller
# may be inside a stream context of its own. A wait on the wrong stream lets the allocator hand
# a freed block to the next allocation while the copy still reads it, or a reader see the
# destination of a copy back before it is written.


# Note: [All-or-nothing transitions]
# A transition touches every storage of a group, and any one of them can fail: a host buffer
# that cannot be pinned, a copy that raises, a storage the device cannot resize. Each transition
# undoes what it did before the failure, and leaves the group in the state it started from with
# every tensor's data in place (or, from "host", still on the host and guarded), then lets the
# error propagate. A freed storage is never left without its host copy.


@dataclasses.dataclass(slots=True)
class _StorageEntry:
    """One distinct storage of the group and what it needs to be restored."""

    storage: torch.UntypedStorage
    key: int  # live_groups.storage_key(storage), read once
    nbytes: int
    tensors: list[torch.Tensor]
    versions: tuple[int, ...]  # the tensors' versions when the copy out started
    host_nbytes: int  # bytes copied: nbytes, or the span's length
    host: torch.Tensor | None = None
    host_event: object = None  # the last copy of a reused host buffer, to order ours after
    span: tuple[int, int] | None = None  # bytes copied; None: the whole storage
    dense: bool = False  # one contiguous tensor over every byte: see Note: [Dense copies]
    alias: torch.Tensor | None = None  # dense, while freed: the copy back's destination


_ABSENT = object()  # a storage not seen yet, in _group_by_storage

# One empty uint8 tensor per device, whose new_empty() makes each byte view.
_EMPTY_BYTES: dict[torch.device, torch.Tensor] = {}


def _bytes_view(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` bytes of ``storage`` from ``offset``."""
    device = storage.device
    empty = _EMPTY_BYTES.get(device)
    if empty is None:
        empty = _EMPTY_BYTES[device] = torch.empty(0, dtype=torch.uint8, device=device)
    view = empty.new_empty(0)  # measured: cheaper than torch.empty(0, dtype=, device=) per call
    return view.set_(storage, offset, (nbytes,), (1,))


def _group_by_storage(tensors: list[torch.Tensor], min_bytes: int,
                      copy_span: bool = False) -> list[_StorageEntry]:
    """One entry per distinct storage that holds bytes, at least ``min_bytes`` of them.

    A group of one tensor (a layer input) is built by :func:`_one_entry` instead.
    """
    entries: dict[int, _StorageEntry | None] = {}  # None: too small, counted
    for t in tensors:
        storage = t.untyped_storage()
        key = storage._cdata
        e = entries.get(key, _ABSENT)
        if e is _ABSENT:
            nbytes = storage.nbytes()
            if nbytes == 0 or nbytes < min_bytes:  # freed already, or too small to be worth it
                _skip_small(nbytes)
                if nbytes:
                    entries[key] = None  # counted once per storage
                continue
            entries[key] = _StorageEntry(storage, key, nbytes, [t], (), nbytes)
        elif e is not None:
            e.tensors.append(t)
    if copy_span:
        for e in entries.values():
            if e is not None and not _spans_all(e):
                _narrow_to_span(e)
    return [e for e in entries.values() if e is not None]


def _one_entry(tensors: list[torch.Tensor], min_bytes: int, copy_span: bool) -> list[_StorageEntry]:
    """The entries of a group of one tensor, without a dict of storages; the entry is dense when
    the tensor spans its whole storage (see Note: [Dense copies]). The entry shares the group's
    list of one tensor (see Note: [Few objects per group])."""
    storage = tensors[0].untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0 or nbytes < min_bytes:
        _skip_small(nbytes)
        return []
    e = _StorageEntry(storage, storage._cdata, nbytes, tensors, (), nbytes)
    if _spans_all(e):
        e.dense = True
    elif copy_span:
        _narrow_to_span(e)
    return [e]


def _skip_small(nbytes: int) -> None:
    """Count a storage below ``SwapConfig.min_swap_bytes`` (one already freed holds nothing)."""
    if nbytes:
        record_skip(SkipReason.TOO_SMALL, nbytes, warn=False)


def _keep_non_resizable(entries: list[_StorageEntry], name: str | None) -> list[_StorageEntry]:
    """The entries whose storage can be freed in place; the others are counted and kept.

    A storage that cannot be resized (a CUDA-graph output of cudagraph trees, ``from_blob``,
    ``torch.frombuffer``, ``torch.from_numpy``, DLPack, an external pool), or one its device
    refuses to resize (see Note: [Storages a device cannot free] in ``device.py``), cannot be
    freed with ``resize_(0)``: it stays on the device
    (``swap_stats().skipped_bytes["non_resizable"]``).
    """
    kept = []
    for e in entries:
        reason = ("Its storage cannot be freed in place (CUDA-graph output, from_blob, DLPack); "
                  "clone it to have it swapped." if not e.storage.resizable()
                  else cannot_free_reason(e.tensors[0]))
        if reason is not None:
            kept.append(e)
            record_skip(SkipReason.NON_RESIZABLE, e.nbytes, where=name, detail=reason)
    return [e for e in entries if all(e is not k for k in kept)]


def _narrow_to_span(e: _StorageEntry) -> None:
    """Copy only the bytes ``e``'s tensors span, when that is less than the whole storage."""
    lo, hi = byte_span(e.tensors)
    if (lo, hi) != (0, e.nbytes):
        e.span, e.host_nbytes = (lo, hi), hi - lo


def _spans_all(e: _StorageEntry) -> bool:
    """The common case, decided without :func:`byte_span`: one contiguous tensor over all bytes.

    A quantized tensor is never dense: no plain host buffer takes its dtype, so its storage is
    copied byte for byte (its scale and zero point stay with the tensor).
    """
    t = e.tensors[0]
    return (len(e.tensors) == 1 and t.storage_offset() == 0 and t.nbytes == e.nbytes
            and t.is_contiguous() and not t.is_quantized)


class SwapTensors:
    """A group of tensors swapped together between device and host.

    Args:
        tensors: The tensors to swap. Invalid ones (see :func:`is_valid_for_swap`) are left out,
            and tensors sharing a storage are swapped once. All must be on one device.
        custom_check_fn: Extra predicate passed to :func:`is_valid_for_swap`. Default: ``None``.
        config: Runtime knobs. Default: ``SwapConfig()``.
        name: Shown in errors, e.g. the layer's name. Default: ``None``.
        copy_span: Copy only the bytes of each storage that the tensors span, and restore just
            those: for storages nobody else holds (see Note: [Ownership rule] in
            ``swap_pass/runtime/ownership.py``); the rest of the storage reads as garbage after
            the restore. Default: ``False`` (whole storages).
        checked: The tensors passed :func:`is_valid_for_swap` already (a manager's claim at
            the layer's entry) and ``config`` is validated (the manager's); only storages freed
            since are left out. A list passed this way is handed over: the group keeps it as
            its :attr:`tensors`. Default: ``False``.
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
            its layer's entry (:func:`swap_pass.runtime.ownership.autograd_mark`), which bounds
            the ownership check at free time. Default: ``0``.
    """

    # A group is made per swapped layer per step: its own attributes live in slots (``__dict__``
    # is made only for attributes a caller adds).
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
            self._entries = _one_entry(tensors, min_bytes, copy_span)
        else:
            self._entries = _group_by_storage(tensors, min_bytes, copy_span)
        if not all(e.storage.resizable() and e.storage.device.type not in _free_checks
                   for e in self._entries):
            self._entries = _keep_non_resizable(self._entries, name)
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
        """Sum the entries' sizes, list their tensors (the ones freed and guarded) and storage
        keys: read at every transition, while the entries change rarely."""
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

        All or nothing: when a host buffer or a copy fails, the group is back in "device", its
        buffers given back, and the error propagates. While the compute stream is capturing a
        graph (CUDA graphs), nothing is copied: the data stays on the device, counted as
        ``swap_stats().skipped_bytes["stream_capture"]``.
        """
        if self.stat is not DEVICE:  # checked inline: every transition passes here
            self._expect(DEVICE, "SwapTensors.swap_to_host")
        entries = self._entries
        for e in entries:  # see Note: [One storage, one live group]
            e.versions = tuple(map(_version, e.tensors))
            live_groups.claim(self, e.key)
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
            self._event = _queue_copies(ds, stream, self._entries, to_host=True,
                                        pinned=self._pinned, compute=self._compute)
        except BaseException:
            self._undo_copy_out(ds, stream)
            raise
        stats.record_swap_out(self._host_nbytes)

    def _undo_copy_out(self, ds: DeviceStreams, stream: torch.Stream | None) -> None:
        """A failed :meth:`swap_to_host`: the copies queued so far may still read the device
        storages and write the buffers, so the compute stream (the storages' allocating stream)
        and the buffers' next taker wait for them; the group is in "device" again."""
        event = _record_after(ds, stream)
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
    # A group begun before a capture (CUDA graphs, NPU graphs) can reach its next transition
    # inside it: a layer's backward captured after its forward ran eagerly, a reader restoring a
    # guarded tensor. Each transition would queue captured work: a wait on an event recorded
    # outside the capture, a free, a re-allocation and a copy from a host buffer that a replay
    # would read again after the pool handed it out. None runs. ``wait_d2h`` keeps the data on
    # the device (the storages are still whole; the copy out needs no wait, as the copy stream
    # is recorded on them, see Note: [Frees on the allocating stream] in ``device.py``) and the
    # group goes on as kept, counted as ``skipped_bytes["stream_capture"]``. ``swap_to_device``
    # and ``wait_h2d`` cannot keep anything (the data is on the host, or on its way back), so
    # they refuse before doing anything: the group stays as it was, its tensors guarded, and the
    # same call after the capture completes it.

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

        All or nothing: when freeing one storage fails (a device that cannot resize it), the
        storages freed before it get their bytes back from the host copy, the group is in
        "device" again with every tensor's data, and the error propagates.
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

    def _free_all(self, ds: DeviceStreams, entries: list[_StorageEntry]) -> None:
        """Free every entry's storage, or none: on a failure, the ones freed are restored."""
        freed: list[_StorageEntry] = []
        try:
            for e in entries:
                if e.dense:  # see Note: [Dense copies]
                    e.alias = e.tensors[0].data
                ds.free_storage(e.storage, self._compute)
                freed.append(e)
        except BaseException as err:
            self._roll_back_frees(ds, freed)
            _add_note(err, f"swap_pass.SwapTensors.wait_d2h: freeing a storage of "
                           f"{self.name or 'a swap group'} failed; every tensor of the group "
                           "keeps its data on the device.")
            raise

    def _roll_back_frees(self, ds: DeviceStreams, freed: list[_StorageEntry]) -> None:
        """Give ``freed`` their bytes back from the host copies, on the compute stream (which
        waited for the copies out), and end in "device" with the buffers given back."""
        compute = self._compute
        for e in freed:
            ds.allocate_storage(e.storage, e.nbytes, compute)
        event = _queue_copies(ds, compute, freed, to_host=False, pinned=self._pinned,
                              compute=compute) if freed else self._event
        self._release_host_buffers(event)
        self._event, self._out_waited = None, False
        self._leave_registry()
        self.stat = DEVICE

    def wait_copy_out(self) -> None:
        """Make the compute stream wait for the device-to-host copy; the state stays "d2h".

        For an ownership check before :meth:`wait_d2h` (the copy's source is a holder of the
        storage until the copy ran); :meth:`wait_d2h` then waits no more. The event stays with
        the group: a group abandoned from "d2h" hands its buffers back with it.
        """
        if self.stat is not D2H:
            self._expect(D2H, "SwapTensors.wait_copy_out")
        if (not self._out_waited and self._event is not None
                and not self._capturing(self._ds or self._streams())):  # then wait_d2h keeps
            self._wait_on_compute(self._event)
            self._out_waited = True

    def swap_to_device(self, stream: torch.Stream | None = None) -> None:
        """Re-allocate the device storages and start copying the data back ("host" -> "h2d").

        All or nothing: when an allocation or a copy fails, the group stays in "host" with its
        host copies (its tensors guarded) and the error propagates; a later restore tries again.
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
            allocated: list[_StorageEntry] = []
            try:
                for e in entries:  # on the compute stream of the swap, the stream of its readers
                    ds.allocate_storage(e.storage, e.nbytes, self._compute)
                    allocated.append(e)
                self._event = _queue_copies(ds, stream, entries, to_host=False,
                                            pinned=self._pinned, compute=self._compute)
            except BaseException:
                self._undo_copy_in(ds, stream, allocated)
                raise
            stats.record_swap_in(self._host_nbytes, self._nbytes)
        self.stat = H2D

    def _undo_copy_in(self, ds: DeviceStreams, stream: torch.Stream | None,
                      allocated: list[_StorageEntry]) -> None:
        """A failed :meth:`swap_to_device`: once the copies queued so far are done, free again
        what was allocated (best effort: a storage that stays allocated is refilled by the next
        restore). The host copies stay; the group stays in "host"."""
        self._wait_on_compute(_record_after(ds, stream))
        for e in allocated:
            try:
                ds.free_storage(e.storage, self._compute)
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

        Storages already freed stay freed (reading their tensors raises ``SwapDataError``; see
        Note: [Guarding freed tensors]); a group still in "d2h" keeps its device data. The group
        ends in state "device", empty.
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
                # A copy in flight still reads or writes device memory this group may be the
                # last to hold: its allocating stream must not reuse it before the copy ends.
                # Ordered by a stream wait, not a host synchronize (which some backends lack).
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

        Data in flight back (``"h2d"``) is always waited for; freed data is brought back only
        inside backward (in forward the read is an error). Returns whether the data is back.
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
        """The device's streams, looked up once; whether our host buffers are pinned with them
        (asked once: it is the pool's bucket key too); the swap's compute stream, fixed here
        unless given (see Note: [The compute stream of a swap])."""
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
        """The stream the group's data is produced, freed, re-allocated and read on (None on
        CPU): fixed when the swap begins."""
        return self._compute

    def _acquire_host_buffers(self) -> bool:
        """Give every entry a host buffer (after :meth:`_streams`); False when host memory ran
        out and policy keeps the data on the device."""
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
        live_groups.release_all(self, self._keys)

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
        # The copy may still read the device storages, which stay with their tensors and may be
        # freed or die any time now: the compute stream (their allocating stream) waits for it,
        # except inside a capture, where the copy stream recorded on them keeps them (see Note:
        # [A group that meets a capture]). It may still write the buffers: whoever takes them
        # next waits on its event.
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


def _queue_copies(ds: DeviceStreams, stream: torch.Stream | None, entries: list[_StorageEntry],
                  to_host: bool, pinned: bool | None, compute: torch.Stream | None) -> object:
    """Queue each entry's copy to (``to_host``) or from its host buffer on ``stream``, ordered
    after the work queued so far on the swap's ``compute`` stream (see Note: [The compute stream
    of a swap]; never looked up here) and, to the host, after a reused buffer's last copy;
    return the event recorded after them.

    A dense entry copies tensor to tensor (see Note: [Dense copies]), any other whole storage
    storage to storage, a span through a byte view of the storage. ``stream`` is None only where
    copies are synchronous (CPU): nothing to order, no event. ``pinned``: the host buffers are
    page-locked (only then is a copy issued without blocking the host).
    """
    if stream is not None:
        ds.wait(stream, ds.record_event(compute))
    for e in entries:
        if to_host and e.host_event is not None:
            ds.wait(stream, e.host_event)
            e.host_event = None
        host = e.host
        if e.dense:  # host has the tensor's dtype and shape: see Note: [Dense copies]
            device = e.tensors[0].data if to_host else e.alias
        elif e.span is None:
            block = host.untyped_storage()
            if block.nbytes() == e.nbytes:  # storage to storage: no byte view to build
                device, host = e.storage, block
            else:  # host is the first bytes of a larger pooled block: copy into just those
                device = _bytes_view(e.storage, 0, e.nbytes)
        else:
            lo, hi = e.span
            device = _bytes_view(e.storage, lo, hi - lo)
        if to_host:
            ds.keep_for_copy(e.tensors[0], stream)  # see Note: [Frees on the allocating stream]
            ds.copy(stream, host, device, pinned=bool(pinned), compute=compute)
        else:
            ds.copy(stream, device, host, pinned=bool(pinned), compute=compute)
    return None if stream is None else ds.record_event(stream)


def _record_after(ds: DeviceStreams, stream: torch.Stream | None) -> object:
    """An event after the work queued on ``stream`` so far (None where copies are synchronous,
    as the transitions keep it), for undoing a transition that failed part-way."""
    return None if stream is None else ds.record_event(stream)


def _add_note(err: BaseException, note: str) -> None:
    """Say what the runtime did about ``err`` beside it, in its traceback."""
    add = getattr(err, "add_note", None)
    if add is not None:
        add(note)


def discard_groups_off_device(*, restore: bool = False) -> int:
    """Discard (or with ``restore``, restore) every group that still holds host buffers.

    Returns how many there were.

    Managers reach their own groups, but a group can outlive its step elsewhere: held by a
    reference cycle (an exception's traceback, say) until the cyclic collector runs, or created
    directly by a user. Its buffers stay in use until then, so :func:`swap_pass.reset` calls
    this to make "reset" mean no host bytes in use, whenever the collector runs.

    A group holds host buffers only between its claim of its storages and its release of them
    (see Note: [One storage, one live group]): taken after the claim in :meth:`swap_to_host`,
    given back before the release (:meth:`wait_h2d`, :meth:`discard`, a copy out abandoned), or
    with the storage a newer group took over. So the live groups are the ones to look at.
    """
    groups = [g for g in live_groups.groups() if any(e.host is not None for e in g._entries)]
    for group in groups:
        restore_or_keep(group) if restore else group.discard()
    return len(groups)


# Groups whose restore failed (a device out of memory, say), with the error: their data is on
# the host only, so they are held here, their tensors guarded, until a restore succeeds (see
# restore_or_keep).
_kept_on_host: list[tuple[SwapTensors, BaseException]] = []


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


def rearm_warnings() -> None:
    """Let the next host-exhaustion warning show again (called by :func:`swap_pass.reset`)."""
    global _warned_keep_on_device
    _warned_keep_on_device = False


def _warn_keep_on_device(name: str | None) -> None:
    global _warned_keep_on_device
    if not _warned_keep_on_device:
        _warned_keep_on_device = True
        warnings.warn(
            f"swap_pass: host memory exhausted while swapping {name or 'a group'}; under "
            "SwapConfig(on_host_exhausted='keep_on_device') such tensors stay on the device. "
            "Training continues with more device memory in use. (Shown once.)",
            RuntimeWarning,
            stacklevel=3,
        )
