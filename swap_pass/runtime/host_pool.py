"""Host buffers for swapped data, reused by size so that steady-state steps allocate nothing.

Fresh pinned allocations cost milliseconds and can synchronize the device, so a buffer released
after its host-to-device copy goes back to a bucket keyed by its block (the bytes the host
allocator sets aside for it, see Note: [Pinned block bytes]) and pinning, and serves the next
request that needs a block of that size: a request is handed a view of its own bytes at the
start of the block (see Note: [One bucket per block]). ``SwapConfig.max_host_bytes`` caps
everything the pool holds, cached buffers included, counted in block bytes; without it the pool
keeps at most :data:`BOUND_FACTOR` times the most bytes it ever had in use at once (see Note:
[The pool's default bound]). Cached buffers are dropped, as few as will do, when a request would
pass either bound; dropping never gives memory back to the system mid-step (see Note: [Nothing
that can synchronize]).

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

__all__ = ["BOUND_FACTOR", "HostBufferPool", "available_host_bytes", "block_bytes", "host_pool",
           "preflight", "return_pinned_memory", "storage_use_count"]


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


# Note: [Pinned block bytes]
# Pinned buffers come from PyTorch's caching host allocator, which rounds every request up to a
# power of two (``CachingHostAllocatorImpl::allocate``) unless it is above the allocator
# setting ``pinned_max_round_threshold_mb`` or ``pinned_max_cached_size_mb`` (both unlimited by
# default; ``PYTORCH_ALLOC_CONF``): a 96 MiB layer input pins a 128 MiB block, and a pool that
# counted requested bytes could pin up to twice ``SwapConfig.max_host_bytes`` while
# ``swap_stats()`` reported less. So the pool counts every buffer at its block size: the host
# gauges, the cap and its error messages all speak of bytes actually set aside. Pageable
# buffers (CPU, ``pin_memory=False``) count their own size. A bucket's block size is fixed
# when its first buffer is allocated; settings changed later apply to new sizes only.

_MIB = 1 << 20
_UNLIMITED = (1 << 64) - 1


def _allocator_settings() -> dict[str, str]:
    """``key: value`` of the allocator settings: the environment, then what torch reports."""
    text = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF",
                                                         "PYTORCH_ALLOC_CONF"))
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        try:
            text += "," + get()
        except RuntimeError:
            pass
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def _setting_bytes(settings: dict[str, str], key: str) -> int:
    """A ``*_mb`` allocator setting in bytes (unlimited when unset or unreadable)."""
    try:
        return int(float(settings[key]) * _MIB)
    except (KeyError, ValueError):
        return _UNLIMITED


def block_bytes(nbytes: int, pinned: bool) -> int:
    """Bytes the host allocator sets aside for a buffer of ``nbytes`` (see Note: [Pinned block
    bytes]).

    Args:
        nbytes: The buffer's size in bytes.
        pinned: Whether the buffer is page-locked (from the caching host allocator).

    Returns:
        ``nbytes`` rounded up to a power of two for a pinned buffer the allocator rounds;
        ``nbytes`` otherwise.
    """
    if not pinned or nbytes <= 1:
        return max(nbytes, 0)
    settings = _allocator_settings()
    if (nbytes > _setting_bytes(settings, "pinned_max_round_threshold_mb")
            or nbytes > _setting_bytes(settings, "pinned_max_cached_size_mb")):
        return nbytes
    return 1 << (nbytes - 1).bit_length()


# Note: [One bucket per block]
# Sequence lengths change from step to step (packing, variable batches), and so do the bytes of
# every layer input. Keyed by exact bytes, each new length missed the pool and pinned fresh
# blocks (milliseconds each, and a possible sync), kept for a length that may never come back:
# 8 lengths from 500 to 777 tokens (hidden 1024, 4 layers) held 112 MiB pinned for steps that
# need 12 MiB. The host allocator rounds a pinned request up to a power of two anyway, so the
# pool allocates that whole block, buckets it by its size, and hands each request a view of its
# own bytes at the block's start: every length between two powers of two reuses the same
# blocks. A bucket's cached buffer keeps the dtype and shape of its last use (the same layer's
# next request takes it as it is); another shape gets a fresh view of the block. Pageable
# buffers (CPU, ``pin_memory=False``) are not rounded: their block is their size.
#
# Note: [The pool's default bound]
# Without ``SwapConfig.max_host_bytes`` the pool still bounds what it holds: at most
# BOUND_FACTOR times the most block bytes it had in use at once since the last ``clear()``
# (``swap_pass.reset()``), which is about one step's need. A fresh buffer that would pass it
# first drops cached ones (the cap's rule: one buffer if one will do, else the largest), so
# buckets of sizes the workload left behind do not stay pinned forever. ``swap_stats()``
# reports the bound as ``host_pool_bound_bytes``.

BOUND_FACTOR = 2  # the pool holds at most this many times its peak bytes in use


class _Bucket(list):
    """Cached buffers of one ``(block bytes, pinned)`` key, and the block bytes each one holds."""

    __slots__ = ("block",)

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block


# Cached buffers taken out under the pool's lock, with their events and whether they are pinned.
_Evicted = list[tuple[torch.Tensor, object, bool]]


class HostBufferPool:
    """A pool of contiguous host tensors, bucketed by size in bytes and pinning.

    A buffer is a flat ``uint8`` tensor unless it was last taken with a ``like`` tensor (see
    :meth:`take`); either way it counts the bytes the host allocator set aside for it (see
    Note: [Pinned block bytes]).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (block bytes, pinned) -> cached buffers (whole blocks; see Note: [One bucket per block])
        self._free: dict[tuple[int, bool], _Bucket] = {}
        # (requested bytes, pinned) -> its bucket's key: the block size is computed once per size
        self._keys: dict[tuple[int, bool], tuple[int, bool]] = {}
        self._high_water = 0  # most block bytes in use at once since clear(): the default bound
        self._reserved_bytes = 0  # in use plus cached: changes only when buffers come or go
        self._in_use_bytes = 0
        self._pending_bytes = 0  # set aside for fresh buffers being allocated
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
        """Block bytes of buffers handed out and not yet released."""
        return self._in_use_bytes

    @property
    def bytes_reserved(self) -> int:
        """Block bytes held in all: in use plus cached for reuse."""
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
            max_host_bytes: ``SwapConfig.max_host_bytes``, in block bytes (see Note: [Pinned
                block bytes]). Default: ``None`` (no cap).
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
        key = self._keys.get((nbytes, pin)) or self._key_of(nbytes, pin)
        lock = self._lock
        lock.acquire()  # not ``with``: see _put_back()
        try:
            bucket = self._free.get(key)
            if bucket:  # a reused buffer, inline on the hot path
                buf = bucket.pop()
                event = self._events.pop(buf.data_ptr(), None) if self._events else None
                self._in_use_bytes += bucket.block
                if self._in_use_bytes > self._peak_in_use_bytes:
                    self._peak_in_use_bytes = self._in_use_bytes
                if self._in_use_bytes > self._high_water:  # not nested: clear() lowers it alone
                    self._high_water = self._in_use_bytes
            else:
                buf, event = None, None
                evicted = self._make_room(key, max_host_bytes)
        finally:
            lock.release()
        if buf is None:
            buf = self._fresh(key, evicted)
        if like is None:
            if buf.dtype is torch.uint8 and buf.dim() == 1 and buf.shape[0] == nbytes:
                return buf, event
            return _bytes_of(buf, nbytes), event
        if buf.dtype is like.dtype and buf.shape == like.shape:
            return buf, event
        return _bytes_of(buf, nbytes).view(like.dtype).view(like.shape), event

    def _key_of(self, nbytes: int, pin: bool) -> tuple[int, bool]:
        """The bucket of requests of ``nbytes``: ``(block bytes, pin)``, computed once per size
        (reading the allocator settings costs microseconds; see Note: [One bucket per block])."""
        key = self._keys[(nbytes, pin)] = (block_bytes(nbytes, pin), pin)
        return key

    def _fresh(self, key: tuple[int, bool], evicted: _Evicted) -> torch.Tensor:
        """Allocate a whole block of bucket ``key``, which :meth:`_make_room` set aside, after
        dropping what it evicted: outside the lock, since either can wait for the device."""
        block, pin = key
        buf = None
        try:
            _drop(evicted)
            buf = self._allocate(block, pin)
        finally:
            with self._lock:
                self._pending_bytes -= block
                if buf is not None:
                    self._take_fresh(key)
        if self.on_allocate is not None:
            self.on_allocate(buf)
        return buf

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

    def forget(self, nbytes: int, pinned: bool | None = None) -> None:
        """Stop counting a handed-out buffer of ``nbytes`` that died with its last user.

        Safe inside finalizers: queued like :meth:`release_deferred`.

        Args:
            nbytes: The buffer's size in bytes (one buffer: its block size is looked up).
            pinned: Whether it was pinned. Default: ``None`` (pinned if the pool pinned
                buffers of that size).
        """
        self._deferred.append(([], nbytes, {}, pinned))

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
            if forgotten:  # from forget(): ``event`` holds whether the buffer was pinned
                with self._lock:
                    block = self._forgotten_block(forgotten, event)
                    self._in_use_bytes -= block
                    self._reserved_bytes -= block
                continue
            for buf in bufs:
                self._put_back(buf, event)
            if stat_deltas:
                stats.record(**stat_deltas)

    def _forgotten_block(self, nbytes: int, pinned: bool | None) -> int:
        """Block bytes of a forgotten buffer of ``nbytes`` (under the lock)."""
        for pin in ((True, False) if pinned is None else (pinned,)):
            key = self._keys.get((nbytes, pin))
            if key is not None:
                return key[0]
        return nbytes

    def _put_back(self, buf: torch.Tensor, event: object = None,
                  pinned: bool | None = None) -> None:
        """Return ``buf`` to its bucket; ``event`` as in :meth:`release`."""
        if self.on_release is not None:
            self.on_release(buf)
        # The whole block: a buffer handed out is a view of its first bytes (see Note: [One
        # bucket per block]).
        key = (buf.untyped_storage().nbytes(), buf.is_pinned() if pinned is None else pinned)
        lock = self._lock
        # acquire()/release() rather than ``with``: a third cheaper per round on CPython 3.11,
        # and this and take() run once per swapped layer each.
        lock.acquire()
        try:
            if event is not None:
                self._events[buf.data_ptr()] = event
            bucket = self._free.get(key)
            if bucket is None:  # not handed out under this key: its block is computed now
                bucket = self._free[key] = _Bucket(block_bytes(*key))
            bucket.append(buf)
            self._in_use_bytes -= bucket.block
        finally:
            lock.release()

    def clear(self) -> None:
        """Drop every cached buffer (buffers in use are not touched; those a graph may still
        read are given up: call it between runs). Pinned memory nothing else holds goes back
        to the system (see Note: [Returning pinned memory])."""
        self.drain_deferred()
        while self._unread:
            self._put_back(*self._unread.popleft())
        with self._lock:
            dropped = self._evict(None)
            self._high_water = self._in_use_bytes
        _give_back(dropped)  # outside the lock: see Note: [Nothing that can synchronize]

    # --- internals ---

    def _evict(self, need: int | None) -> _Evicted:
        """Take cached buffers out of their buckets until ``need`` block bytes are freed (all
        of them when None), under the lock; return them with their events and pinning, to be
        dropped (:func:`_drop`, :func:`_give_back` from :meth:`clear`) once the lock is
        released.

        The smallest single buffer that frees ``need`` goes, else the largest ones first: few
        buffers, and none freed beyond what is needed.
        """
        cached = sorted(((key[1], b) for key, b in self._free.items() if b),
                        key=lambda item: item[1].block)
        if need is None:
            need = sum(b.block * len(b) for _, b in cached)
        one = next((item for item in cached if item[1].block >= need), None)
        evicted, freed = [], 0
        for pinned, bucket in [one] if one is not None else reversed(cached):
            while bucket and freed < need:
                buf = bucket.pop()
                evicted.append((buf, self._events.pop(buf.data_ptr(), None), pinned))
                freed += bucket.block
        self._reserved_bytes -= freed
        return evicted

    def _take_fresh(self, key: tuple[int, bool]) -> None:
        """Count a fresh block of bucket ``key`` as in use (under the lock)."""
        block = key[0]
        if key not in self._free:
            self._free[key] = _Bucket(block)
        self._in_use_bytes += block
        if self._in_use_bytes > self._peak_in_use_bytes:
            self._peak_in_use_bytes = self._in_use_bytes
        if self._in_use_bytes > self._high_water:
            self._high_water = self._in_use_bytes
        self._allocations += 1
        self._reserved_bytes += block

    @property
    def bound_bytes(self) -> int:
        """Most block bytes the pool keeps without ``SwapConfig.max_host_bytes``: see Note:
        [The pool's default bound]."""
        return BOUND_FACTOR * self._high_water

    def gauges(self) -> dict[str, int]:
        """The host fields of :class:`~swap_pass.SwapStats`: bytes in use (and their peak),
        bytes reserved, fresh allocations (peak and allocations since :meth:`restart_gauges`),
        and the pool's default bound."""
        with self._lock:
            return {"host_bytes_in_use": self._in_use_bytes,
                    "peak_host_bytes_in_use": self._peak_in_use_bytes,
                    "host_bytes_reserved": self._reserved_bytes,
                    "host_allocations": self._allocations,
                    "host_pool_bound_bytes": self.bound_bytes}

    def restart_gauges(self) -> None:
        """Restart the peak at the bytes now in use and the allocation count at zero."""
        with self._lock:
            self._peak_in_use_bytes = self._in_use_bytes
            self._allocations = 0

    def _make_room(self, key: tuple[int, bool], max_host_bytes: int | None) -> _Evicted:
        """Set aside a fresh block of bucket ``key`` under ``max_host_bytes`` and the pool's
        default bound (under the lock; see Note: [The pool's default bound]).

        Returns:
            The cached buffers evicted for it (dropped by :meth:`_fresh` once the lock is
            released).

        Raises:
            HostMemoryError: buffers in use (or being allocated) leave no room for the block
                under ``max_host_bytes`` even with every cached one dropped; then none is
                dropped.
        """
        block = key[0]
        committed = self._pending_bytes + self._in_use_bytes
        limit = BOUND_FACTOR * max(self._high_water, committed + block)
        if max_host_bytes is not None:
            if committed + block > max_host_bytes:
                raise HostMemoryError(
                    "host_pool", block, max(max_host_bytes - committed, 0),
                    f"SwapConfig.max_host_bytes={max_host_bytes} would be passed",
                )
            limit = min(limit, max_host_bytes)
        over = self._reserved_bytes + self._pending_bytes + block - limit
        evicted = self._evict(over) if over > 0 else []
        self._pending_bytes += block
        return evicted

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
# next pinned allocation instead of returning it: dropping our references alone does not give
# pinned memory back to the system. Where the torch build has torch.accelerator.empty_host_cache,
# the pool calls it after dropping its cached pinned buffers in clear() (swap_pass.reset()), and
# only there: the allocator frees the blocks nothing else holds, once the copies that used them
# completed. A buffer evicted in a step (max_host_bytes, the default bound) is only dropped: its
# block stays in the allocator's cache, where the next pinned allocation of its size takes it.
#
# Note: [Nothing that can synchronize]
# Freeing pinned memory (cudaFreeHost, also when the last reference to a block above
# pinned_max_cached_size_mb dies), empty_host_cache and a fresh pinned allocation (cudaHostAlloc)
# can each wait for the device. empty_host_cache frees every idle pinned block of the process,
# so it never runs inside a step's forward or backward: only clear() calls it. None of them runs
# while the pool's lock is held: a thread taking or giving back a buffer would wait for the
# device too. The lock only moves buffers and counts bytes; evicted buffers are dropped, and
# fresh ones allocated, after it is released.


def return_pinned_memory() -> bool:
    """Return cached pinned blocks to the OS (see Note: [Returning pinned memory]).

    Returns:
        Whether this torch build could (``torch.accelerator.empty_host_cache`` exists, an
        accelerator is present, and its backend has a host allocator).
    """
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
    if empty_host_cache is None or not torch.accelerator.is_available():
        return False
    try:
        empty_host_cache()
    except (RuntimeError, NotImplementedError):  # a backend without a caching host allocator
        return False
    return True


def _drop(evicted: _Evicted) -> None:
    """Drop evicted buffers and their events: their blocks go back to the host allocator's
    cache, nothing is given back to the system (a step may be running; see Note: [Nothing that
    can synchronize]). Never under the pool's lock."""
    evicted.clear()  # the last references: the buffers and events go here


def _give_back(evicted: _Evicted) -> None:
    """Drop buffers cleared out of the pool, then return pinned memory if any was pinned (only
    from :meth:`HostBufferPool.clear`: see Note: [Returning pinned memory]). Never under the
    pool's lock."""
    if not evicted:
        return
    pinned = any(pin for _, _, pin in evicted)
    _drop(evicted)
    if pinned:
        return_pinned_memory()


_EMPTY_BYTES = torch.empty(0, dtype=torch.uint8)  # its new_empty() makes each view below


def _bytes_of(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` bytes of a pool buffer's block as a flat ``uint8`` tensor (see Note:
    [One bucket per block])."""
    return _EMPTY_BYTES.new_empty(0).set_(buf.untyped_storage(), 0, (nbytes,), (1,))


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
