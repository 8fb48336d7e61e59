"""Host buffers for swapped data, reused by size so that steady-state steps allocate nothing.

Fresh pinned allocations cost milliseconds and can synchronize the device, so a buffer released
after its host-to-device copy goes back to a bucket keyed by ``(nbytes, pinned)`` and serves the
next request of that size. ``SwapConfig.max_host_bytes`` caps everything the pool holds, cached
buffers included; cached buffers are dropped first when a request would pass the cap.
"""

from __future__ import annotations

import collections
import os
import threading

import torch

from swap_pass.runtime import stats
from swap_pass.runtime.device import host_buffer_released
from swap_pass.runtime.errors import HostMemoryError

__all__ = ["HostBufferPool", "available_host_bytes", "host_pool", "preflight"]


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
    """A pool of flat ``uint8`` host tensors, bucketed by size and pinning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._in_use_bytes = 0
        # Buffers handed back from finalizers; see Note: [Releasing from __del__].
        self._deferred: collections.deque[tuple[list[torch.Tensor], int, dict[str, int]]] = (
            collections.deque()
        )

    @property
    def bytes_in_use(self) -> int:
        """Bytes in buffers handed out and not yet released."""
        return self._in_use_bytes

    @property
    def bytes_reserved(self) -> int:
        """Bytes held in all: in use plus cached for reuse."""
        return self._in_use_bytes + self._free_bytes

    def acquire(self, nbytes: int, *, pin: bool, max_host_bytes: int | None = None) -> torch.Tensor:
        """Return a host buffer of exactly ``nbytes`` bytes.

        Raises:
            HostMemoryError: the request would pass ``max_host_bytes``, or allocation failed.
        """
        self.drain_deferred()
        key = (nbytes, pin)
        with self._lock:
            bucket = self._free.get(key)
            if bucket:
                buf = bucket.pop()
                self._free_bytes -= nbytes
                self._take(nbytes, fresh=False)
                return buf
            self._make_room(nbytes, max_host_bytes)
        buf = self._allocate(nbytes, pin)
        with self._lock:
            self._take(nbytes, fresh=True)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse. Its device copies must be ordered before any reuse."""
        self.drain_deferred()
        self._put_back(buf)

    def release_deferred(self, bufs: list[torch.Tensor], **stat_deltas: int) -> None:
        """Queue ``bufs`` for release without taking any lock (safe inside ``__del__``).

        Note: [Releasing from __del__]
        A garbage-collected group gives its buffers back from ``__del__``, which the collector
        may run in the middle of a pool or stats update on the same thread. Taking the pool's
        lock there would deadlock, and re-entering a half-done update would corrupt counters,
        so finalizers only append to a deque (atomic in CPython); every pool operation, and
        ``swap_stats()``, drains it first.
        """
        self._deferred.append((bufs, 0, stat_deltas))

    def forget(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` of handed-out buffers that died with their last user.

        Safe inside finalizers: queued like :meth:`release_deferred`.
        """
        self._deferred.append(([], nbytes, {}))

    def drain_deferred(self) -> None:
        """Apply what :meth:`release_deferred` and :meth:`forget` queued."""
        while self._deferred:
            try:
                bufs, forgotten, stat_deltas = self._deferred.popleft()
            except IndexError:  # drained by another thread meanwhile
                return
            for buf in bufs:
                self._put_back(buf)
            if forgotten:
                with self._lock:
                    self._in_use_bytes -= forgotten
                stats.record(host_bytes_in_use=-forgotten, host_bytes_reserved=-forgotten)
            if stat_deltas:
                stats.record(**stat_deltas)

    def _put_back(self, buf: torch.Tensor) -> None:
        host_buffer_released(buf)
        nbytes = buf.numel()
        with self._lock:
            self._free.setdefault((nbytes, buf.is_pinned()), []).append(buf)
            self._free_bytes += nbytes
            self._in_use_bytes -= nbytes
        stats.record(host_bytes_in_use=-nbytes)

    def clear(self) -> None:
        """Drop every cached buffer (buffers in use are not touched)."""
        self.drain_deferred()
        with self._lock:
            dropped = self._free_bytes
            self._free.clear()
            self._free_bytes = 0
        stats.record(host_bytes_reserved=-dropped)

    # --- internals ---

    def _take(self, nbytes: int, *, fresh: bool) -> None:
        self._in_use_bytes += nbytes
        if fresh:
            stats.record(host_bytes_in_use=nbytes, host_bytes_reserved=nbytes, host_allocations=1)
        else:
            stats.record(host_bytes_in_use=nbytes)

    def _make_room(self, nbytes: int, max_host_bytes: int | None) -> None:
        if max_host_bytes is None or self.bytes_reserved + nbytes <= max_host_bytes:
            return
        dropped = self._free_bytes
        self._free.clear()
        self._free_bytes = 0
        stats.record(host_bytes_reserved=-dropped)
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


_pool = HostBufferPool()


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
