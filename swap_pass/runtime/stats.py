"""Process-wide counters of what the runtime moved and holds, and why a tensor was not swapped."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from swap_pass.state import counts as _counts
from swap_pass.state import skipped_bytes as _skipped_bytes
from swap_pass.state import skips as _skips
from swap_pass.state import stats_lock as _lock
from swap_pass.state import warn_once

__all__ = ["SkipReason", "SwapStats", "clear", "record", "record_released", "record_skip",
           "record_swap_in", "record_swap_out", "set_host_gauges", "snapshot"]


# --- Why a tensor was not swapped: one counter per reason, and one warning per reason and place ---
# Note: [Never a silent zero]
#     A memory library that quietly swaps nothing is worse than one that fails: the user sees exact
#     gradients, no error, and no memory saved. So every path that decides *not* to move a tensor
#     it was offered (a layer input, a saved activation, a graph candidate) calls
#     :func:`record_skip` with a :class:`SkipReason`. ``swap_stats().skipped_bytes`` and
#     ``swap_stats().skips`` then hold the bytes and the count per reason, and reasons that mean
#     "you may be losing the saving you asked for" warn once per reason and place (a layer's name,
#     a graph, a SmartSwap instance) until :func:`swap_pass.reset`.


class SkipReason(str, enum.Enum):
    """Why a tensor offered for swapping stayed where it was.

    Attributes:
        USER_DATA: Inputs, parameters, buffers, detached tensors and their views: never freed.
        SHARED_STORAGE: Another live tensor (a sibling view, a kept ``detach()``) shares the
            storage, so freeing it would harm a reader outside the swap.
        SUBCLASS: A tensor subclass whose data cannot be reached as one plain local tensor.
        NO_STORAGE: Sparse, nested, meta or other tensors without one plain strided storage.
        NON_RESIZABLE: The storage cannot be freed in place (CUDA-graph outputs, ``from_blob``,
            DLPack, external allocators).
        HOST_EXHAUSTED: No host buffer could be had (``on_host_exhausted="keep_on_device"``).
        TOO_SMALL: Smaller than ``SwapConfig.min_swap_bytes``.
        CUSTOM_CHECK: The user's ``custom_check_fn`` said no.
        DYNAMIC_SHAPE: A compiled graph's candidate whose size is not known when planning.
        NO_LAYERS: A model or graph in which no layer boundary was found.
        STREAM_CAPTURE: The compute stream was capturing a graph (CUDA graphs): a copy or free
            would be captured and replayed later.
        NO_SWAP: Offered inside :func:`swap_pass.no_swap`, the user's opt-out.
        MODULE_FILTER: Saved inside a module the user's ``module_filter_fn`` left out.
        OFFLOAD_FALLBACK: A ``PREFER_CPU_OFFLOAD`` tag that could not be honoured (an op that
            returns no tensor, or the backend's saved value is not the tagged node's output):
            the tensor stays saved on the device.
        HANDED_BACK: A step of a fine-tuning tool's activation offloading (TRL, torchtune) left to
            the tool's own hooks: the model's layers are not checkpointed or not found
            (``swap_pass.integrations.offload_flags``). ``skips`` counts the steps; no bytes.
    """

    USER_DATA = "user_data"
    SHARED_STORAGE = "shared_storage"
    SUBCLASS = "subclass"
    NO_STORAGE = "no_storage"
    NON_RESIZABLE = "non_resizable"
    HOST_EXHAUSTED = "host_exhausted"
    TOO_SMALL = "too_small"
    CUSTOM_CHECK = "custom_check"
    DYNAMIC_SHAPE = "dynamic_shape"
    NO_LAYERS = "no_layers"
    STREAM_CAPTURE = "stream_capture"
    NO_SWAP = "no_swap"
    MODULE_FILTER = "module_filter"
    OFFLOAD_FALLBACK = "offload_fallback"
    HANDED_BACK = "handed_back"


# Reasons that are the user's own choice or the rule working as intended warn nowhere: their
# counters are enough. The others cost the user a saving they asked for.
_QUIET = frozenset({SkipReason.USER_DATA, SkipReason.TOO_SMALL, SkipReason.CUSTOM_CHECK,
                    SkipReason.NO_SWAP, SkipReason.MODULE_FILTER})


def record_skip(reason: SkipReason, nbytes: int, *, where: str | None = None,
                detail: str = "", warn: bool = True) -> None:
    """Count a tensor of ``nbytes`` not swapped for ``reason``; warn once per reason and place.

    Args:
        reason: Why it stays.
        nbytes: Bytes that stay on the device because of it.
        where: The place to name in the warning (a layer, a graph, a SmartSwap instance).
            Default: ``None`` (one warning per reason for the whole process).
        detail: What the user can do about it, appended to the warning. Default: ``""``.
        warn: Whether this reason may warn here at all. Default: ``True``.
    """
    reason = SkipReason(reason)
    _count_skip(reason.value, nbytes)
    if warn and reason not in _QUIET:
        warn_once(reason.value, where or "", _message(reason, nbytes, where, detail))


def _message(reason: SkipReason, nbytes: int, where: str | None, detail: str) -> str:
    place = f" in {where}" if where else ""
    return (f"swap_pass: a tensor of {nbytes} bytes{place} stays on the device ({reason.value}). "
            f"swap_stats().skipped_bytes[{reason.value!r}] counts it."
            f"{' ' + detail if detail else ''}"
            " (Shown once per reason and place until swap_pass.reset().)")


# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SwapStats:
    """A snapshot of the runtime's counters (see :func:`swap_pass.swap_stats`).

    Attributes:
        swap_outs: Groups or tensors whose device-to-host copy was started.
        swap_ins: Groups or tensors whose host-to-device copy was started.
        swapped_out_bytes: Bytes copied device to host, in total.
        swapped_in_bytes: Bytes copied host to device, in total.
        host_bytes_in_use: Host bytes now holding swapped data.
        peak_host_bytes_in_use: Highest ``host_bytes_in_use`` since the last reset.
        host_bytes_reserved: Host bytes the buffer pool holds, in use or cached for reuse.
        host_allocations: Fresh host buffers allocated (pool misses).
        host_pool_bound_bytes: Most host bytes the buffer pool keeps without
            ``SwapConfig.max_host_bytes``: twice the most it had in use at once since the last
            :func:`swap_pass.reset` (block bytes; see Note: [The pool's default bound] in
            ``swap_pass/runtime/host_pool.py``). Cached buffers beyond it are dropped.
        device_bytes_released: Device bytes now freed because their data is on the host, on
            every path: the eager paths and SmartSwap free storages themselves; in traced and
            compiled graphs the swapped tensor's storage counts once the graph has dropped it
            after ``swap_pass::wait`` (a storage the graph keeps, or that Inductor reuses for
            another buffer, is not counted), until its prefetch brings the bytes back.
        peak_device_bytes_released: Highest ``device_bytes_released`` since the last reset: the
            saving, in bytes, the same measure for every way in.
        kept_on_device: Swap-outs skipped because host memory was exhausted.
        skipped_shared_bytes: Bytes of layer-input storages kept on the device because another
            live tensor shares them (a sibling view, a buffer); see Note: [Ownership rule] in
            ``swap_pass/runtime/freeing.py``.
        skipped_user_bytes: Bytes of layer-input storages kept on the device because they are
            user data: inputs, parameters, buffers, detached tensors and their views.
        skipped_bytes: Bytes not swapped, per reason (the values of
            :class:`swap_pass.runtime.stats.SkipReason`: ``"user_data"``, ``"shared_storage"``,
            ``"subclass"``, ``"no_storage"``, ``"non_resizable"``, ``"host_exhausted"``,
            ``"too_small"``, ``"custom_check"``, ``"dynamic_shape"``, ``"no_layers"``); a reason
            appears once something was skipped for it. See Note: [Never a silent zero] in
            ``swap_pass/runtime/stats.py``.
        skips: Tensors (or, for ``"no_layers"``, graphs and models) not swapped, per reason.
    """

    swap_outs: int = 0
    swap_ins: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    host_bytes_in_use: int = 0
    peak_host_bytes_in_use: int = 0
    host_bytes_reserved: int = 0
    host_allocations: int = 0
    host_pool_bound_bytes: int = 0
    device_bytes_released: int = 0
    peak_device_bytes_released: int = 0
    kept_on_device: int = 0
    skipped_shared_bytes: int = 0
    skipped_user_bytes: int = 0
    skipped_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    skips: dict[str, int] = dataclasses.field(default_factory=dict)


# The transitions take the lock with acquire()/release(), not ``with``: cheaper per round.
_acquire, _release = _lock.acquire, _lock.release
# The counters live in a plain dict: they change a few times per swapped layer per step, and a
# dict update is several times cheaper than getattr/setattr on the dataclass. The transitions
# every swap makes have their own record_* function: no keyword dict to build and walk.
# The host gauges are the host buffer pool's own figures (see set_host_gauges): the pool keeps
# them as it hands buffers out, so taking and giving back a buffer costs no record() call.
_HOST_GAUGES = ("host_bytes_in_use", "peak_host_bytes_in_use", "host_bytes_reserved",
                "host_allocations", "host_pool_bound_bytes")
_PER_REASON = ("skipped_bytes", "skips")
_FIELDS = tuple(f.name for f in dataclasses.fields(SwapStats)
                if f.name not in _HOST_GAUGES + _PER_REASON)
_counts.update(dict.fromkeys(_FIELDS, 0))
# The two older per-reason fields, kept in step with skipped_bytes.
_LEGACY_FIELD = {"user_data": "skipped_user_bytes", "shared_storage": "skipped_shared_bytes"}


# Until the host buffer pool registers its own (set_host_gauges): no host buffers.
def _host_gauges() -> dict[str, int]:
    return dict.fromkeys(_HOST_GAUGES, 0)


def _restart_host_gauges() -> None:
    return None


def set_host_gauges(read: Callable[[], dict[str, int]], restart: Callable[[], None]) -> None:
    """Where :func:`snapshot` reads the host gauges, and how :func:`clear` restarts their
    peak and allocation count (the process-wide host buffer pool calls this once)."""
    global _host_gauges, _restart_host_gauges
    _host_gauges, _restart_host_gauges = read, restart


def record(**deltas: int) -> None:
    """Add ``deltas`` to the named counters, keeping the peaks up to date.

    Raises:
        KeyError: A name is not a :class:`SwapStats` field kept here (the host gauges are the
            pool's).
    """
    counts = _counts
    with _lock:
        for name, delta in deltas.items():
            counts[name] += delta
        if counts["device_bytes_released"] > counts["peak_device_bytes_released"]:
            counts["peak_device_bytes_released"] = counts["device_bytes_released"]


def record_swap_out(nbytes: int) -> None:
    """A copy of ``nbytes`` to the host started (``swap_outs``, ``swapped_out_bytes``)."""
    _acquire()
    try:
        _counts["swap_outs"] += 1
        _counts["swapped_out_bytes"] += nbytes
    finally:
        _release()


def record_swap_in(nbytes: int, device_bytes_back: int = 0) -> None:
    """A copy of ``nbytes`` back to the device started (``swap_ins``, ``swapped_in_bytes``),
    into ``device_bytes_back`` bytes of device memory allocated again for it."""
    _acquire()
    try:
        _counts["swap_ins"] += 1
        _counts["swapped_in_bytes"] += nbytes
        _counts["device_bytes_released"] -= device_bytes_back
    finally:
        _release()


def record_released(nbytes: int) -> None:
    """``nbytes`` of device memory freed (negative: allocated again), keeping the peak."""
    _acquire()
    try:
        value = _counts["device_bytes_released"] + nbytes
        _counts["device_bytes_released"] = value
        if value > _counts["peak_device_bytes_released"]:
            _counts["peak_device_bytes_released"] = value
    finally:
        _release()


def _count_skip(reason: str, nbytes: int) -> None:
    """One tensor of ``nbytes`` not swapped for ``reason`` (use
    :func:`swap_pass.runtime.stats.record_skip`, which also warns)."""
    with _lock:
        _skipped_bytes[reason] = _skipped_bytes.get(reason, 0) + nbytes
        _skips[reason] = _skips.get(reason, 0) + 1
        legacy = _LEGACY_FIELD.get(reason)
        if legacy is not None:
            _counts[legacy] += nbytes


def bytes_copied() -> int:
    """Bytes copied so far, device to host and back (two reads without the lock: SmartSwap's
    copy clock reads it around each copy call; see Note: [One timed copy a step])."""
    return _counts["swapped_out_bytes"] + _counts["swapped_in_bytes"]


def snapshot() -> SwapStats:
    """Return a copy of the counters."""
    host = _host_gauges()
    with _lock:
        return SwapStats(**_counts, **host, skipped_bytes=dict(_skipped_bytes), skips=dict(_skips))


def clear() -> None:
    """Zero the counters; gauges (bytes now released or held) stay, and their peaks restart."""
    with _lock:
        released = _counts["device_bytes_released"]
        _counts.update(dict.fromkeys(_FIELDS, 0), device_bytes_released=released,
                       peak_device_bytes_released=released)
        _skipped_bytes.clear()
        _skips.clear()
    _restart_host_gauges()
