"""Host buffers for swapped data, reused by size so that steady-state steps allocate nothing.

Fresh pinned allocations cost milliseconds and can synchronize the device, so a buffer released
after its host-to-device copy goes back to a bucket keyed by ``(nbytes, pinned)`` and serves the
next request of that size. ``SwapConfig.max_host_bytes`` caps everything the pool holds, cached
buffers included; cached buffers are dropped first when a request would pass the cap.

Note: [A released buffer carries its last copy's event]
A buffer may be given back while a copy on some stream still reads or writes it (its releaser
ordered only its own stream after the copy, or none: a group dropping a storage another group
took over). Keyed by size alone, it can go to a copy on another stream, thread or device that
is not ordered after that one. So :meth:`HostBufferPool.release` takes the event of the
buffer's last copy, and whoever takes the buffer gets it back from :meth:`take_event` and makes
its own copy stream wait on it first: ordering without blocking the host.

Note: [Buffers a graph may read again]
A compiled graph keeps its ``swap_out`` host tensor for backward, and a graph kept with
``backward(retain_graph=True)`` reads it again in its next backward. Released at the first
backward's wait, the buffer would go to the next forward's ``swap_out``, which overwrites it:
the retained graph's second backward reads another step's data. Such buffers are given back
with :meth:`HostBufferPool.release_when_unread` and return to the pool only once nothing but
the pool holds their storage (every graph that could read them is gone); they count as in use
until then.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable

import torch

from swap_pass.runtime import stats
from swap_pass.runtime.errors import HostMemoryError

__all__ = ["HostBufferPool", "available_host_bytes", "host_pool", "preflight",
           "return_pinned_memory", "storage_use_count"]


def storage_use_count(t: torch.Tensor) -> int:
    """How many holders ``t``'s storage has (tensors over it, storage objects), ours included."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_ONE_HOLDER = storage_use_count(torch.empty(1))


def available_host_bytes() -> int:
    """Host memory the OS reports as available (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostBufferPool:
    """A pool of contiguous host tensors, bucketed by size in bytes and pinning.

    A buffer is a flat ``uint8`` tensor unless it was last taken with a ``like`` tensor (see
    :meth:`take`); either way only its bytes count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._reserved_bytes = 0  # in use plus cached: changes only when buffers come or go
        self._in_use_bytes = 0
        self._peak_in_use_bytes = 0  # since the last restart_gauges()
        self._allocations = 0  # fresh buffers since the last restart_gauges()
        self._events: dict[int, object] = {}  # data_ptr -> event of the buffer's last copy
        # Buffers handed back from finalizers; see Note: [Releasing from __del__].
        self._deferred: collections.deque[
            tuple[list[torch.Tensor], int, dict[str, int], object]] = collections.deque()
        # Buffers back once nothing else holds them; see Note: [Buffers a graph may read again].
        self._unread: collections.deque[tuple[torch.Tensor, object]] = collections.deque()
        # Told about every buffer given back (swap_pass.testing.stream_model poisons it).
        self.on_release: Callable[[torch.Tensor], None] | None = None
        # Told about every fresh buffer (swap_pass.testing.stream_model tells host from device).
        self.on_allocate: Callable[[torch.Tensor], None] | None = None

    @property
    def bytes_in_use(self) -> int:
        """Bytes in buffers handed out and not yet released."""
        return self._in_use_bytes

    @property
    def bytes_reserved(self) -> int:
        """Bytes held in all: in use plus cached for reuse."""
        return self._reserved_bytes

    def acquire(self, nbytes: int, *, pin: bool, max_host_bytes: int | None = None) -> torch.Tensor:
        """Return a host buffer of exactly ``nbytes`` bytes (its last copy's event stays for
        :meth:`take_event`).

        Raises:
            HostMemoryError: the request would pass ``max_host_bytes``, or allocation failed.
        """
        buf, event = self.take(nbytes, pin=pin, max_host_bytes=max_host_bytes)
        if event is not None:
            with self._lock:
                self._events[buf.data_ptr()] = event
        return buf

    def take(self, nbytes: int, pin: bool, max_host_bytes: int | None = None,
             like: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """Return a host buffer of exactly ``nbytes`` bytes and the event of its last copy.

        The event is what :meth:`take_event` would return: the caller's copy stream must wait on
        it before using the buffer (None when no copy may still touch it). One lock round for
        both, on the path every swap-out takes.

        Args:
            nbytes: The buffer's size in bytes.
            pin: Whether it must be page-locked (part of the bucket's key).
            max_host_bytes: ``SwapConfig.max_host_bytes``. Default: ``None`` (no cap).
            like: A tensor of ``nbytes`` bytes: the buffer comes with its dtype and shape
                (contiguous), so that the tensor copies into it as it is, without a byte view
                of either side. A buffer given back keeps that shape, and the next request of
                the same shape (the same layer in the next step) takes it without a view op.
                Default: ``None`` (a flat ``uint8`` buffer).

        Raises:
            HostMemoryError: the request would pass ``max_host_bytes``, or allocation failed.
        """
        if self._deferred or self._unread:  # what drain_deferred() checks first, spared a call
            self.drain_deferred()
        lock = self._lock
        lock.acquire()  # not ``with``: see _put_back()
        try:
            bucket = self._free.get((nbytes, pin))
            if bucket:  # a reused buffer: _take(nbytes, fresh=False), inline on the hot path
                buf = bucket.pop()
                event = self._events.pop(buf.data_ptr(), None) if self._events else None
                self._in_use_bytes += nbytes
                if self._in_use_bytes > self._peak_in_use_bytes:
                    self._peak_in_use_bytes = self._in_use_bytes
            else:
                buf = None
                self._make_room(nbytes, max_host_bytes)
        finally:
            lock.release()
        if buf is None:
            buf, event = self._allocate(nbytes, pin), None
            if self.on_allocate is not None:
                self.on_allocate(buf)
            with self._lock:
                self._take(nbytes, fresh=True)
        if like is None:
            return (buf if buf.dtype is torch.uint8 and buf.dim() == 1 else _flat(buf)), event
        if buf.dtype is like.dtype and buf.shape == like.shape:
            return buf, event
        return _flat(buf).view(like.dtype).view(like.shape), event

    def release(self, buf: torch.Tensor, event: object = None, pinned: bool | None = None) -> None:
        """Give ``buf`` back for reuse.

        Args:
            buf: A buffer from :meth:`acquire` or :meth:`take`.
            event: Recorded after the last copy that reads or writes ``buf``, when the
                releaser has not ordered every later user after it. Default: ``None``.
            pinned: Whether ``buf`` is pinned, when the caller knows (it asked for it).
                Default: ``None`` (asked of the buffer).
        """
        if self._deferred or self._unread:  # what drain_deferred() checks first, spared a call
            self.drain_deferred()
        self._put_back(buf, event, pinned)

    def release_when_unread(self, buf: torch.Tensor, event: object = None) -> None:
        """Give ``buf`` back once the pool holds its storage alone (safe inside finalizers).

        See Note: [Buffers a graph may read again]; ``event`` as in :meth:`release`.
        """
        self._unread.append((buf, event))

    def take_event(self, buf: torch.Tensor) -> object:
        """The event ``buf`` was released with (see Note: [A released buffer carries its last
        copy's event]), or None; the caller's copy stream must wait on it before using ``buf``."""
        with self._lock:
            return self._events.pop(buf.data_ptr(), None)

    def release_deferred(self, bufs: list[torch.Tensor], event: object = None,
                         **stat_deltas: int) -> None:
        """Queue ``bufs`` for release without taking any lock (safe inside ``__del__``);
        ``event`` as in :meth:`release`.

        Note: [Releasing from __del__]
        A garbage-collected group gives its buffers back from ``__del__``, which the collector
        may run in the middle of a pool or stats update on the same thread. Taking the pool's
        lock there would deadlock, and re-entering a half-done update would corrupt counters,
        so finalizers only append to a deque (atomic in CPython); every pool operation, and
        ``swap_stats()``, drains it first.
        """
        self._deferred.append((bufs, 0, stat_deltas, event))

    def forget(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` of handed-out buffers that died with their last user.

        Safe inside finalizers: queued like :meth:`release_deferred`.
        """
        self._deferred.append(([], nbytes, {}, None))

    def drain_deferred(self) -> None:
        """Apply what :meth:`release_deferred` and :meth:`forget` queued, and give back the
        buffers of :meth:`release_when_unread` that nothing else holds any more."""
        if not self._deferred and not self._unread:  # the common case, on every pool call
            return
        for _ in range(len(self._unread)):
            try:
                buf, event = self._unread.popleft()
            except IndexError:
                break
            if storage_use_count(buf) == _ONE_HOLDER:
                self._put_back(buf, event)
            else:
                self._unread.append((buf, event))
        while self._deferred:
            try:
                bufs, forgotten, stat_deltas, event = self._deferred.popleft()
            except IndexError:  # drained by another thread meanwhile
                return
            for buf in bufs:
                self._put_back(buf, event)
            if forgotten:
                with self._lock:
                    self._in_use_bytes -= forgotten
                    self._reserved_bytes -= forgotten
            if stat_deltas:
                stats.record(**stat_deltas)

    def _put_back(self, buf: torch.Tensor, event: object = None,
                  pinned: bool | None = None) -> None:
        """Return ``buf`` to its bucket; ``event`` as in :meth:`release`."""
        if self.on_release is not None:
            self.on_release(buf)
        nbytes = buf.nbytes
        key = (nbytes, buf.is_pinned() if pinned is None else pinned)
        lock = self._lock
        # acquire()/release() rather than ``with``: a third cheaper per round on CPython 3.11,
        # and this and take() run once per swapped layer each.
        lock.acquire()
        try:
            if event is not None:
                self._events[buf.data_ptr()] = event
            bucket = self._free.get(key)
            if bucket is None:
                bucket = self._free[key] = []
            bucket.append(buf)
            self._in_use_bytes -= nbytes
        finally:
            lock.release()

    def clear(self) -> None:
        """Drop every cached buffer (buffers in use are not touched; those a graph may still
        read are given up: call it between runs)."""
        self.drain_deferred()
        while self._unread:
            self._put_back(*self._unread.popleft())
        with self._lock:
            pinned = self._drop_cached()
        if pinned:
            return_pinned_memory()

    # --- internals ---

    def _drop_cached(self) -> bool:
        """Drop the cached buffers; return whether any was pinned."""
        pinned = False
        for (_, pin), bucket in self._free.items():
            pinned = pinned or (pin and bool(bucket))
            for buf in bucket:
                self._events.pop(buf.data_ptr(), None)
        self._free.clear()
        self._reserved_bytes = self._in_use_bytes
        return pinned

    def _take(self, nbytes: int, *, fresh: bool) -> None:
        self._in_use_bytes += nbytes
        if self._in_use_bytes > self._peak_in_use_bytes:
            self._peak_in_use_bytes = self._in_use_bytes
        self._allocations += fresh
        if fresh:
            self._reserved_bytes += nbytes

    def gauges(self) -> dict[str, int]:
        """The host fields of :class:`~swap_pass.SwapStats`: bytes in use (and their peak),
        bytes reserved, fresh allocations (peak and allocations since :meth:`restart_gauges`)."""
        with self._lock:
            return {"host_bytes_in_use": self._in_use_bytes,
                    "peak_host_bytes_in_use": self._peak_in_use_bytes,
                    "host_bytes_reserved": self._reserved_bytes,
                    "host_allocations": self._allocations}

    def restart_gauges(self) -> None:
        """Restart the peak at the bytes now in use and the allocation count at zero."""
        with self._lock:
            self._peak_in_use_bytes = self._in_use_bytes
            self._allocations = 0

    def _make_room(self, nbytes: int, max_host_bytes: int | None) -> None:
        if max_host_bytes is None or self.bytes_reserved + nbytes <= max_host_bytes:
            return
        if self._drop_cached():
            return_pinned_memory()
        if self._in_use_bytes + nbytes > max_host_bytes:
            raise HostMemoryError(
                "host_pool", nbytes, max(max_host_bytes - self._in_use_bytes, 0),
                f"SwapConfig.max_host_bytes={max_host_bytes} would be passed",
            )

    @staticmethod
    def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        except RuntimeError as err:
            raise HostMemoryError(
                "host_pool", nbytes, available_host_bytes(),
                f"allocating a {'pinned ' if pin else ''}host buffer failed ({err})",
            ) from err


# Note: [Returning pinned memory]
# Pinned buffers come from PyTorch's caching host allocator, which keeps a freed block for the
# next pinned allocation instead of returning it: dropping our references alone bounds pinned
# bytes by neither SwapConfig.max_host_bytes nor swap_pass.reset(). Where the torch build has
# torch.accelerator.empty_host_cache, the pool calls it after dropping cached pinned buffers
# (clear(), reset(), a request over max_host_bytes); the allocator frees the blocks nothing else
# holds, once the copies that used them completed.


def return_pinned_memory() -> bool:
    """Return cached pinned blocks to the OS (see Note: [Returning pinned memory]).

    Returns:
        Whether this torch build could (``torch.accelerator.empty_host_cache`` exists and an
        accelerator is present).
    """
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
    if empty_host_cache is None or not torch.accelerator.is_available():
        return False
    empty_host_cache()
    return True


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous pool buffer as a flat ``uint8`` tensor (a view)."""
    return buf.view(-1).view(torch.uint8)


_pool = HostBufferPool()
stats.set_host_gauges(_pool.gauges, _pool.restart_gauges)


def host_pool() -> HostBufferPool:
    """The process-wide host buffer pool."""
    return _pool


def preflight(required_bytes: int, max_host_bytes: int | None = None,
              available: int | None = None) -> None:
    """Check, before the first step, that ``required_bytes`` of host memory can be had.

    Args:
        required_bytes: Host bytes the swapped tensors of one step will need at once.
        max_host_bytes: ``SwapConfig.max_host_bytes``, if set. Default: ``None``.
        available: Host bytes available; read from the OS when None. Default: ``None``.

    Raises:
        HostMemoryError: naming both the bytes needed and the bytes available.
    """
    if available is None:
        available = available_host_bytes() + _pool.bytes_reserved - _pool.bytes_in_use
    if max_host_bytes is not None and max_host_bytes < available:
        available, why = max_host_bytes, "SwapConfig.max_host_bytes is too small"
    else:
        why = "not enough host memory is available"
    if required_bytes > available:
        raise HostMemoryError("preflight", required_bytes, available, why)
