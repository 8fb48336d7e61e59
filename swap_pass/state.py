"""Every process-wide table of swap_pass, named once, and the one way to warn once.

Each table says who fills it, who empties it, what :func:`swap_pass.reset` does to it, and
whether it is thread-safe. The modules that use a table import it by name (``from
swap_pass.state import transfers as _transfers``): the object is the same, the read
costs no attribute lookup on the swap path, and no module defines a table of its own.

``reset()`` (:func:`swap_pass.reset`) empties every table that holds pending swap state:
groups off the device are brought back, FIFOs and registries emptied, counters zeroed, every
warning armed again. It keeps what describes the process rather than a step: measured
calibrations and rates, registrations made at import, caches of streams and generated classes,
and entries tied to live tensors, which leave when their tensor does.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["rearm_warnings", "warn_once"]

# --- warnings ---------------------------------------------------------------------------------

# Keys ``(what, where)`` that warned already. Filled by warn_once, emptied by rearm_warnings
# (reset(): emptied). Thread-safe: under _warned_lock.
_warned_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def warn_once(key: str, where: str, message: str, *, stacklevel: int = 3) -> bool:
    """Warn ``message`` (a ``RuntimeWarning``) unless ``(key, where)`` warned already.

    Args:
        key: What the warning is about (a skip reason, ``"keep_on_device"``, ...).
        where: The place it names (a layer, a graph); ``""`` for once per process.
        message: The warning's text.
        stacklevel: As for ``warnings.warn``, counted from the caller. Default: ``3``.

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
    """Let every warning show once more (called by :func:`swap_pass.reset`)."""
    with _warned_lock:
        _warned.clear()


# --- reset --------------------------------------------------------------------------------------

# What reset() also calls: each way in's own pending state (graph-op registries, SmartSwap's
# step, the SAC regions). Filled at import by register_reset_hook; never emptied. Not
# thread-safe: appended to at import only.
reset_hooks: list[Callable[[], None]] = []

# --- counters (runtime/stats.py) --------------------------------------------------------------

# swap_stats()'s counters, per field; per skip reason, bytes and tensors. Filled by every
# transition and skip (stats.record_*), zeroed by reset(). Thread-safe: under stats_lock.
stats_lock = threading.Lock()
counts: dict[str, int] = {}
skipped_bytes: dict[str, int] = {}
skips: dict[str, int] = {}

# --- groups (runtime/group.py, runtime/group.py, runtime/freeing.py) -----------

# Groups a restore could not bring back (device memory exhausted), with the error. Filled by
# restore_or_keep, emptied when a later restore succeeds (reset() tries each once more and
# keeps those that still fail, raising). Not thread-safe: autograd's thread and reset() only.
kept_on_host: list[tuple[Any, BaseException]] = []

# The live group of each storage (one storage, one group), by storage key, weakly. Filled by
# group.claim_storage, emptied by release_storages / reset(). Thread-safe: under owners_lock.
owners_lock = threading.Lock()
owners: dict[int, weakref.ref] = {}

# Where each guarded tensor's data went, by the tensor's id: a weak reference to the group that
# freed it, or a name. Filled by freed_guard.guard_freed, emptied by unguard or when a given-up
# tensor dies (reset(): emptied as each group is restored). Not thread-safe: the group's owner.
guards: dict[int, weakref.ref | str] = {}

# A zero-byte tensor per device (the bytes view of a freed storage). Filled on first use, kept
# (a cache). Thread-safe: a racing fill stores an equal tensor.
empty_bytes: dict[Any, Any] = {}

# --- who holds a storage (runtime/freeing.py) ---------------------------------------------

# Holders accounted for at a layer's entry (a wrapper's base locals), by the input's id, with
# weak references. Filled by account_holders, emptied when the input dies. Not thread-safe:
# the forward's thread.
entry_holders: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}

# Per wrapper class: references to its inner tensor when the wrapper alone holds it. Filled on
# the first wrapper of a class (a calibration), kept. Thread-safe: a racing fill stores the same.
refs_when_alone: dict[type, int] = {}

# --- devices (runtime/device.py) ------------------------------------------------------------

# Per device type: why a storage cannot be freed in place (None: it can). Filled at import or
# load by register_free_check (torch_npu, the test accelerator), kept. Not thread-safe: import.
free_checks: dict[str, Callable[[Any], str | None]] = {}

# DeviceStreams per (device, use_streams). Filled on first use under streams_lock, kept (a
# cache: the streams outlive every group that uses them). Reads take no lock.
streams_lock = threading.Lock()
streams: dict[tuple[Any, bool], Any] = {}

# --- eager layer chains (runtime/chain.py) --------------------------------------------------

# Every live LayerChain by tag (what SwapLayerInputManager.manager_map shows), weakly, and the
# chains no handle owns (decorators, managers built directly), strongly. Filled when a chain is
# made or rejoins; a chain leaves ``chains`` with its owner, ``chains_by_tag`` at its last
# remove(); reset() retires every chain's managers and empties ``chains_by_tag``. Thread-safe:
# under chains_lock.
chains_lock = threading.RLock()
chains: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
chains_by_tag: dict[str, Any] = {}

# --- the graph ops (graph/ops.py) -----------------------------------------------------------

# Per in-flight copy of a graph op, by the host tensor's key: its transfer (event, stream,
# source kept alive), its bytes, the finalizer that waits if the tensor dies first, the device
# bytes freed meanwhile; per prefetch, whether it was kept on the device. Filled by swap_out /
# swap_in / prefetch, emptied by their wait or the finalizer, and by reset(). Thread-safe: under
# ops_lock (reentrant: finalizers may run during GC inside a locked section).
ops_lock = threading.RLock()
transfers: dict[int, Any] = {}
host_bytes: dict[int, int] = {}
finalizers: dict[int, weakref.finalize] = {}
released: dict[int, int] = {}
kept_on_device: dict[int, bool] = {}

# --- opting out (opt_out.py) ----------------------------------------------------------------

# Per thread: how deep inside no_swap() it is. Filled and emptied by the context; reset() keeps
# it (a block still open stays open). Thread-local.
no_swap_depth = threading.local()

# --- selective checkpointing (sac.py) -------------------------------------------------------

# Regions whose data is on the host, weakly, in the order their forwards ended. Filled when a
# region's forward ends, emptied when it is recomputed, by reset(). Thread-safe: under
# forward_order_lock.
forward_order_lock = threading.Lock()
forward_order: list[weakref.ref] = []

# --- SmartSwap (smart/smart_swap.py) --------------------------------------------------------

# The SmartSwap instances inside their ``with`` block, innermost last. Filled by __enter__,
# emptied by __exit__; reset() keeps them (their pending state is cleared). Not thread-safe:
# one training loop.
active_smart_swaps: list[Any] = []

# --- measured rates (cost/probes.py) --------------------------------------------------------

# Copy bandwidth and matmul rate per (what, device, dtype, threads), and the probes running now.
# Filled by the first probe of a key, kept (facts of the machine; clear_measured_rates empties
# them). Thread-safe: under rates_lock.
rates_lock = threading.Lock()
rates: dict[tuple, float] = {}
pending_rates: dict[tuple, threading.Event] = {}

# --- integrations (integrations/torchtitan.py) ----------------------------------------------

# torchtitan's config class per original class, with the swap field added. Filled on first use,
# kept (a class is made once). Not thread-safe: configuration time.
torchtitan_config_classes: dict[type, type] = {}
