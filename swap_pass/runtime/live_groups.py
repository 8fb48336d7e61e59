"""Which live swap group holds each storage: a storage is in at most one.

Note: [One storage, one live group]
A layer that returns its input, or one tensor fed as ``hidden_states`` to two layers, puts one
storage into two groups. Both would copy it out, and the first ``wait_d2h`` would free it while
the second group's copy still reads it; the first restore would then write it back under the
second group's feet. So a group claims its storages when its copy to the host starts, and a
storage claimed by a group still copying it out (state ``"d2h"``) moves to the newer group: the
older one drops it, giving its host buffer back with the event of its copy (see Note: [A
released buffer carries its last copy's event]). The newer group is the one backward restores
first (backward runs layers in reverse), so every reader finds the data back in time. A storage
already freed by another group is never claimed: its tensors are not valid for a swap. Groups
give their storages up when their data is back on the device.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch

__all__ = ["claim", "clear", "groups", "owner", "release_all", "storage_key"]


class _Group(Protocol):
    def drop_storage(self, key: int) -> None: ...


_lock = threading.Lock()
_acquire, _release = _lock.acquire, _lock.release  # cheaper than ``with`` (see runtime/stats.py)
_owners: dict[int, weakref.ref] = {}


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage (its ``StorageImpl``), stable across resizes."""
    return storage._cdata


def owner(storage: torch.UntypedStorage) -> _Group | None:
    """The live group holding ``storage``, if any."""
    with _lock:
        ref = _owners.get(storage_key(storage))
    return ref() if ref is not None else None


def claim(group: _Group, key: int) -> None:
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


def release_all(group: _Group, keys: Iterable[int]) -> None:
    """Forget ``group`` as the holder of the storages ``keys`` (its data is back, or it was
    dropped)."""
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


def groups() -> list[_Group]:
    """The live groups, each once, in no particular order."""
    with _lock:
        refs = list(_owners.values())
    found: dict[int, _Group] = {}
    for ref in refs:
        group = ref()
        if group is not None:
            found[id(group)] = group
    return list(found.values())


def clear() -> None:
    """Forget every holder (:func:`swap_pass.reset`)."""
    with _lock:
        _owners.clear()
