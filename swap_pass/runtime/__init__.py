"""The device-generic swap runtime shared by the eager, graph and adaptive paths."""

from __future__ import annotations

from collections.abc import Callable

from swap_pass.runtime import stats as _stats
from swap_pass.runtime.chain import SwapLayerInputManager
from swap_pass.runtime.device import accelerator_type, device_streams, is_async_device
from swap_pass.runtime.errors import HostMemoryError, SwapDataError, SwapStateError
from swap_pass.runtime.group import (
    SwapState,
    SwapTensors,
    clear_owners,
    discard_groups_off_device,
    is_valid_for_swap,
    kept_groups,
    retry_kept_groups,
    unrestored_error,
)
from swap_pass.runtime.host_pool import available_host_bytes, host_pool, preflight
from swap_pass.runtime.stats import SkipReason, SwapStats
from swap_pass.state import rearm_warnings, reset_hooks

__all__ = [
    "HostMemoryError",
    "SwapDataError",
    "SkipReason",
    "SwapLayerInputManager",
    "SwapState",
    "SwapStateError",
    "SwapStats",
    "SwapTensors",
    "accelerator_type",
    "available_host_bytes",
    "device_streams",
    "host_pool",
    "is_async_device",
    "is_valid_for_swap",
    "preflight",
    "register_reset_hook",
    "reset",
    "swap_stats",
]

def register_reset_hook(fn: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`reset` call ``fn`` (a path's own pending state, e.g. graph-op registries)."""
    if fn not in reset_hooks:
        reset_hooks.append(fn)
    return fn


def swap_stats() -> SwapStats:
    """A snapshot of the runtime's counters: swaps done, bytes moved, host bytes held."""
    host_pool().drain_deferred()
    return _stats.snapshot()


def reset() -> None:
    """Drop all managers and pending swap state, free cached host buffers, zero the counters.

    Safe at any point, also between a forward and its backward: every storage still off the
    device is restored first (a later backward then runs without swapping it), and layers whose
    swap is still enabled register again at their next call. An active ``SmartSwap`` keeps
    working: its hooks, stage and plan stay; only its pending state for the step is cleared.

    Raises:
        SwapDataError: a group could not be restored (device memory exhausted): everything else
            was reset, and that group's data stays in host memory, its tensors guarded, until a
            later ``reset()`` or its backward brings it back. Nothing is dropped.
    """
    earlier = kept_groups()  # kept by an earlier reset: tried once more here
    for fn in list(reset_hooks):
        fn()
    SwapLayerInputManager.reset_all()
    discard_groups_off_device(restore=True)
    retry_kept_groups(earlier)
    failed = kept_groups()
    clear_owners()
    host_pool().clear()
    rearm_warnings()
    _stats.clear()
    if failed:
        raise unrestored_error(failed, "reset")
