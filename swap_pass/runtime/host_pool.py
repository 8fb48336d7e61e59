"""Host buffers for swapped data, reused by size so that steady-state steps allocate nothing.

Fresh pinned allocations cost milliseconds and can synchronize the device, so released buffers
are cached by block bytes (Note: [Pinned block bytes]) and pinning, each serving later requests
as a view of its first bytes (Note: [One bucket per block]). All the pool holds is bounded by
``SwapConfig.max_host_bytes``, else by :data:`BOUND_FACTOR` times its peak bytes in use (Note:
[The pool's default bound]); cached buffers are dropped, as few as will do, to stay under it,
never giving memory back to the system mid-step (Note: [Nothing that can synchronize]).

Note: [A released buffer carries its last copy's event]
A buffer may be given back while a copy still reads or writes it (its releaser ordered only its
own stream after the copy, or none: a group dropping a storage another group took over). Keyed
by size alone, it can go to a copy on another stream, thread or device not ordered after that
one. So :meth:`HostBufferPool.release` takes the event of its last copy, and :meth:`take` hands
it to the next taker, whose copy stream waits on it first: ordering without blocking the host.

Note: [Buffers a graph may read again]
A compiled graph keeps its ``swap_out`` host tensor for backward, and a graph kept with
``backward(retain_graph=True)`` reads it again in its next backward; released at the first
backward, the buffer would be overwritten by the next forward's ``swap_out``. Such buffers are
given back with :meth:`HostBufferPool.release_when_unread` and return to the pool only once
nothing but the pool holds their storage (no graph can read them); until then they are in use.
"""

from __future__ import annotations

import collections
import operator
import os
import threading

import torch

from swap_pass.runtime import stats
from swap_pass.runtime.errors import HostMemoryError
from swap_pass.runtime.freeing import holders

__all__ = ["BOUND_FACTOR", "HostBufferPool", "available_host_bytes", "block_bytes", "host_pool",
           "meminfo_bytes", "preflight", "return_pinned_memory"]


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``"MemAvailable"``, ``"MemTotal"``) in bytes; None where the
    file or the field is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_bytes() -> int:
    """Host memory the OS reports as available (``MemAvailable``), in bytes."""
    found = meminfo_bytes("MemAvailable")
    if found is not None:
        return found
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# Note: [Pinned block bytes]
# PyTorch's caching host allocator rounds every pinned request up to a power of two
# (``CachingHostAllocatorImpl::allocate``) unless it is above ``pinned_max_round_threshold_mb``
# or ``pinned_max_cached_size_mb`` (both unlimited by default; ``PYTORCH_ALLOC_CONF``): a 96 MiB
# layer input pins a 128 MiB block, and a pool counting requested bytes could pin up to twice
# ``SwapConfig.max_host_bytes`` while ``swap_stats()`` reported less. So the pool counts every
# buffer at its block size (gauges, cap and error messages); pageable buffers (CPU,
# ``pin_memory=False``) count their own size. A bucket's block size is fixed at its first
# allocation; settings changed later apply to new sizes only.

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
    """Bytes the host allocator sets aside for a buffer (Note: [Pinned block bytes]).

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
# Sequence lengths, and so every layer input's bytes, change between steps (packing, variable
# batches). Keyed by exact bytes, each new length missed the pool and pinned fresh blocks
# (milliseconds each, a possible sync) kept for a length that may never return: 8 lengths from
# 500 to 777 tokens (hidden 1024, 4 layers) held 112 MiB pinned for steps needing 12 MiB. As the
# allocator rounds a pinned request up to a power of two anyway, the pool allocates that whole
# block, buckets it by its size and hands each request a view of its first bytes: every length
# between two powers of two reuses the same blocks. A cached buffer keeps its last dtype and shape
# (the same layer's next request takes it as is); another shape gets a fresh view. Pageable
# buffers (CPU, ``pin_memory=False``) are not rounded.
#
# Note: [The pool's default bound]
# Without ``SwapConfig.max_host_bytes`` the pool keeps at most BOUND_FACTOR times the most block
# bytes it had in use at once since the last ``clear()`` (``swap_pass.reset()``), about one
# step's need. A fresh buffer that would pass it first drops cached ones (as under the cap: one
# if one will do, else the largest), so buckets of sizes the workload left behind do not stay
# pinned forever. ``swap_stats()`` reports it as ``host_pool_bound_bytes``.

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
    """A pool of contiguous host tensors, bucketed by block bytes and pinning.

    A buffer is flat ``uint8`` unless last taken with ``like`` (:meth:`take`); either way it
    counts its block bytes (Note: [Pinned block bytes]).
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

    bytes_in_use = property(operator.attrgetter("_in_use_bytes"),
                            doc="Block bytes of buffers handed out and not yet released.")
    bytes_reserved = property(operator.attrgetter("_reserved_bytes"),
                              doc="Block bytes held in all: in use plus cached for reuse.")

    def take(self, nbytes: int, pin: bool, max_host_bytes: int | None = None,
             like: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """Return a host buffer of exactly ``nbytes`` bytes and the event of its last copy.

        The caller's copy stream must wait on the event (None when no copy may still touch the
        buffer) before using it. Both come from one lock round.

        Args:
            nbytes: The buffer's size in bytes.
            pin: Whether it must be page-locked (part of the bucket's key).
            max_host_bytes: ``SwapConfig.max_host_bytes``, in block bytes (see Note: [Pinned
                block bytes]). Default: ``None`` (no cap).
            like: A tensor of ``nbytes`` bytes: the buffer comes in its dtype and shape
                (contiguous), so the tensor copies into it without a byte view of either side;
                given back, it keeps that shape for the next such request (the same layer next
                step). Default: ``None`` (a flat ``uint8`` buffer).

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
        """The bucket key of ``nbytes``, cached per size (reading settings costs microseconds)."""
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
        return buf

    def release(self, buf: torch.Tensor, event: object = None, pinned: bool | None = None) -> None:
        """Give ``buf`` back for reuse.

        Args:
            buf: A buffer from :meth:`take`.
            event: Recorded after the last copy that reads or writes ``buf``, when the
                releaser has not ordered every later user after it. Default: ``None``.
            pinned: Whether ``buf`` is pinned, when the caller knows (it asked for it).
                Default: ``None`` (asked of the buffer).
        """
        if self._deferred or self._unread:  # what drain_deferred() checks first, spared a call
            self.drain_deferred()
        self._put_back(buf, event, pinned)

    def release_when_unread(self, buf: torch.Tensor, event: object = None) -> None:
        """Give ``buf`` back once the pool holds its storage alone (safe inside finalizers; Note:
        [Buffers a graph may read again]); ``event`` as in :meth:`release`."""
        self._unread.append((buf, event))

    def release_deferred(self, bufs: list[torch.Tensor], event: object = None,
                         **stat_deltas: int) -> None:
        """Queue ``bufs`` for release without taking any lock (safe inside ``__del__``);
        ``event`` as in :meth:`release`.

        Note: [Releasing from __del__]
        A collected group gives its buffers back from ``__del__``, which may run in the middle
        of a pool or stats update on the same thread: taking the pool's lock would deadlock and
        re-entering a half-done update would corrupt counters. So finalizers only append to a
        deque (atomic in CPython); every pool operation, and ``swap_stats()``, drains it first.
        """
        self._deferred.append((bufs, 0, stat_deltas, event))

    def forget(self, nbytes: int, pinned: bool | None = None) -> None:
        """Stop counting a handed-out buffer that died with its last user (queued like
        :meth:`release_deferred`: safe inside finalizers).

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
            if holders(buf) == 1:
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
        # The whole block: a handed-out buffer views its first bytes (Note: [One bucket per block])
        key = (buf.untyped_storage().nbytes(), buf.is_pinned() if pinned is None else pinned)
        lock = self._lock
        # acquire()/release(), not ``with``: cheaper; this and take() run once per swapped layer.
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
        """Under the lock, take out cached buffers until ``need`` block bytes are freed (all
        when None): the smallest single one that frees ``need``, else the largest first. Returns
        them with their events and pinning, dropped once the lock is released (:func:`_drop`,
        or :func:`_give_back` from :meth:`clear`)."""
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
        """The host fields of :class:`~swap_pass.SwapStats`: bytes in use, their peak and fresh
        allocations (since :meth:`restart_gauges`), bytes reserved and the default bound."""
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
        """Under the lock, set aside a fresh block of bucket ``key`` within ``max_host_bytes``
        and the default bound (Note: [The pool's default bound]); return the cached buffers
        evicted for it (:meth:`_fresh` drops them after the lock).

        Raises:
            HostMemoryError: buffers in use or being allocated leave no room for the block under
                ``max_host_bytes`` even with every cached one dropped (then none is dropped).
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
# PyTorch's caching host allocator keeps a freed pinned block for the next pinned allocation, so
# dropping our references does not give pinned memory back to the system. Where the build has
# torch.accelerator.empty_host_cache, clear() (swap_pass.reset()) calls it after dropping the
# cached pinned buffers, and nothing else does: the allocator frees the blocks nothing else holds
# once the copies that used them completed. A buffer evicted in a step (max_host_bytes, the
# default bound) is only dropped: its block stays cached for the next pinned allocation of its size.
#
# Note: [Nothing that can synchronize]
# Freeing pinned memory (cudaFreeHost, also when the last reference to a block above
# pinned_max_cached_size_mb dies), empty_host_cache and a fresh pinned allocation (cudaHostAlloc)
# can each wait for the device. empty_host_cache frees every idle pinned block of the process, so
# only clear() calls it, never a step's forward or backward. None of them runs under the pool's
# lock (a thread taking or giving back a buffer would wait for the device too): the lock only
# moves buffers and counts bytes; evicted buffers are dropped, and fresh ones allocated, after.


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
    """Drop evicted buffers and their events, never under the pool's lock: their blocks stay in
    the allocator's cache (a step may be running: Note: [Nothing that can synchronize])."""
    evicted.clear()  # the last references: the buffers and events go here


def _give_back(evicted: _Evicted) -> None:
    """Drop buffers cleared out of the pool, then return pinned memory if any was pinned; only
    from :meth:`HostBufferPool.clear`, never under its lock (Note: [Returning pinned memory])."""
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
