"""Why a tensor was not swapped: one counter per reason, and one warning per reason and place.

Note: [Never a silent zero]
    A memory library that quietly swaps nothing is worse than one that fails: the user sees exact
    gradients, no error, and no memory saved. So every path that decides *not* to move a tensor
    it was offered (a layer input, a saved activation, a graph candidate) calls
    :func:`record_skip` with a :class:`SkipReason`. ``swap_stats().skipped_bytes`` and
    ``swap_stats().skips`` then hold the bytes and the count per reason, and reasons that mean
    "you may be losing the saving you asked for" warn once per reason and place (a layer's name,
    a graph, a SmartSwap instance) until :func:`swap_pass.reset`.
"""

from __future__ import annotations

import enum
import threading
import warnings

from swap_pass.runtime import stats

__all__ = ["SkipReason", "rearm_warnings", "record_skip", "warn_once"]


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


# Reasons that are the user's own choice or the rule working as intended warn nowhere: their
# counters are enough. The others cost the user a saving they asked for.
_QUIET = frozenset({SkipReason.USER_DATA, SkipReason.TOO_SMALL, SkipReason.CUSTOM_CHECK,
                    SkipReason.NO_SWAP, SkipReason.MODULE_FILTER})

_warned_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


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
    stats.record_skip(reason.value, nbytes)
    if warn and reason not in _QUIET:
        warn_once(reason.value, where or "", _message(reason, nbytes, where, detail))


def _message(reason: SkipReason, nbytes: int, where: str | None, detail: str) -> str:
    place = f" in {where}" if where else ""
    return (f"swap_pass: a tensor of {nbytes} bytes{place} stays on the device ({reason.value}). "
            f"swap_stats().skipped_bytes[{reason.value!r}] counts it."
            f"{' ' + detail if detail else ''}"
            " (Shown once per reason and place until swap_pass.reset().)")


def warn_once(key: str, where: str, message: str, *, stacklevel: int = 3) -> bool:
    """Warn ``message`` (a ``RuntimeWarning``) unless ``(key, where)`` warned already.

    Returns:
        Whether the warning was shown.
    """
    with _warned_lock:
        if (key, where) in _warned:
            return False
        _warned.add((key, where))
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
    return True


def rearm_warnings() -> None:
    """Let every skip warning show again (called by :func:`swap_pass.reset`)."""
    with _warned_lock:
        _warned.clear()
