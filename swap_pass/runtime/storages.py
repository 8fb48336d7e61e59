"""A group's storages: one entry per distinct storage, what of it is copied, and the copies.

Each :class:`StorageEntry` holds the bytes to copy (the whole storage, or the span its tensors
cover) and its host buffer; :func:`queue_copies` issues the copies on a side stream, ordered
after the group's compute stream (see :mod:`swap_pass.runtime.group`).
"""

from __future__ import annotations

import dataclasses

import torch

from swap_pass.runtime.device import DeviceStreams, cannot_free_reason
from swap_pass.runtime.freeing import byte_span
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.state import empty_bytes as _EMPTY_BYTES

__all__ = ["StorageEntry", "bytes_view", "group_by_storage", "keep_non_resizable", "one_entry",
           "queue_copies", "record_after"]


# Note: [Dense copies]
# The common entry is one contiguous tensor over its whole storage (a layer input). Its host
# buffer comes from the pool in the tensor's dtype and shape, and the copies run tensor to tensor:
# out from ``t.data``, back into ``alias``, a second ``t.data`` made just before the free (while
# ``t`` is still plain, after the ownership check counted the storage's holders) and dropped with
# the host buffer. Both are plain detached tensors over the storage: no autograd history, no bump
# of ``t``'s version, no pass through the freed tensor's guard. A storage-to-storage copy (every
# other whole storage) builds a byte view of each side; the bench's bare copy-and-free reference
# (2 CPU cores, torch 2.13) took 21.7 us per layer with tensor copies, 30.2 with storage copies.


@dataclasses.dataclass(slots=True)
class StorageEntry:
    """One distinct storage of the group and what it needs to be restored."""

    storage: torch.UntypedStorage
    key: int  # group.storage_key(storage), read once
    nbytes: int
    tensors: list[torch.Tensor]
    versions: tuple[int, ...]  # the tensors' versions when the copy out started
    host_nbytes: int  # bytes copied: nbytes, or the span's length
    host: torch.Tensor | None = None
    host_event: object = None  # the last copy of a reused host buffer, to order ours after
    span: tuple[int, int] | None = None  # bytes copied; None: the whole storage
    dense: bool = False  # one contiguous tensor over every byte: see Note: [Dense copies]
    alias: torch.Tensor | None = None  # dense, while freed: the copy back's destination


_ABSENT = object()  # a storage not seen yet, in group_by_storage


def bytes_view(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` bytes of ``storage`` from ``offset``."""
    device = storage.device
    empty = _EMPTY_BYTES.get(device)
    if empty is None:
        empty = _EMPTY_BYTES[device] = torch.empty(0, dtype=torch.uint8, device=device)
    view = empty.new_empty(0)  # cheaper per call than torch.empty(0, dtype=, device=)
    return view.set_(storage, offset, (nbytes,), (1,))


def group_by_storage(tensors: list[torch.Tensor], min_bytes: int,
                      copy_span: bool = False) -> list[StorageEntry]:
    """One entry per distinct non-empty storage of at least ``min_bytes`` (one tensor:
    :func:`one_entry`)."""
    entries: dict[int, StorageEntry | None] = {}  # None: too small, counted
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
            entries[key] = StorageEntry(storage, key, nbytes, [t], (), nbytes)
        elif e is not None:
            e.tensors.append(t)
    if copy_span:
        for e in entries.values():
            if e is not None and not _spans_all(e):
                _narrow_to_span(e)
    return [e for e in entries.values() if e is not None]


def one_entry(tensors: list[torch.Tensor], min_bytes: int, copy_span: bool) -> list[StorageEntry]:
    """A one-tensor group's entries, without a dict: dense when the tensor spans its storage (Note:
    [Dense copies]); the entry shares the group's list (Note: [Few objects per group])."""
    storage = tensors[0].untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0 or nbytes < min_bytes:
        _skip_small(nbytes)
        return []
    e = StorageEntry(storage, storage._cdata, nbytes, tensors, (), nbytes)
    if _spans_all(e):
        e.dense = True
    elif copy_span:
        _narrow_to_span(e)
    return [e]


def _skip_small(nbytes: int) -> None:
    """Count a storage below ``SwapConfig.min_swap_bytes`` (one already freed holds nothing)."""
    if nbytes:
        record_skip(SkipReason.TOO_SMALL, nbytes, warn=False)


def keep_non_resizable(entries: list[StorageEntry], name: str | None) -> list[StorageEntry]:
    """The entries whose storage can be freed in place; the others are counted and kept.

    A storage that cannot be resized (a cudagraph-trees output, ``from_blob``,
    ``torch.frombuffer``, ``torch.from_numpy``, DLPack, an external pool) or that its device
    refuses to resize (Note: [Storages a device cannot free] in ``device.py``) stays on the
    device (``swap_stats().skipped_bytes["non_resizable"]``).
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


def _narrow_to_span(e: StorageEntry) -> None:
    """Copy only the bytes ``e``'s tensors span, when that is less than the whole storage."""
    lo, hi = byte_span(e.tensors)
    if (lo, hi) != (0, e.nbytes):
        e.span, e.host_nbytes = (lo, hi), hi - lo


def _spans_all(e: StorageEntry) -> bool:
    """One contiguous tensor over all bytes (without :func:`byte_span`); never a quantized one:
    no plain host buffer takes its dtype (its scale and zero point stay with the tensor)."""
    t = e.tensors[0]
    return (len(e.tensors) == 1 and t.storage_offset() == 0 and t.nbytes == e.nbytes
            and t.is_contiguous() and not t.is_quantized)


def queue_copies(ds: DeviceStreams, stream: torch.Stream | None, entries: list[StorageEntry],
                  to_host: bool, pinned: bool | None, compute: torch.Stream | None) -> object:
    """Queue each entry's copy to (``to_host``) or from its host buffer on ``stream``; return
    the event recorded after them.

    Ordered after the work queued so far on the swap's ``compute`` stream (Note: [The compute
    stream of a swap]; never looked up here) and, to the host, after a reused buffer's last copy.
    Dense entries copy tensor to tensor (Note: [Dense copies]), other whole storages storage to
    storage, spans through a byte view. ``stream`` is None only where copies are synchronous
    (CPU): nothing to order, no event. ``pinned``: the host buffers are page-locked (only then
    is a copy issued without blocking the host).
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
                device = bytes_view(e.storage, 0, e.nbytes)
        else:
            lo, hi = e.span
            device = bytes_view(e.storage, lo, hi - lo)
        if to_host:
            ds.keep_for_copy(e.tensors[0], stream)  # see Note: [Frees on the allocating stream]
            ds.copy(stream, host, device, pinned=bool(pinned))
        else:
            ds.copy(stream, device, host, pinned=bool(pinned))
    return None if stream is None else ds.record_event(stream)


def record_after(ds: DeviceStreams, stream: torch.Stream | None) -> object:
    """An event after the work queued on ``stream`` (None where copies are synchronous), for
    undoing a transition that failed part-way."""
    return None if stream is None else ds.record_event(stream)
