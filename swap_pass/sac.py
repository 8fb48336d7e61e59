"""``selective_checkpoint_contexts``: selective activation checkpointing whose offload tags swap.

One checkpointed region, an op ``mm`` tagged ``MUST_CPU_OFFLOAD`` (or ``PREFER_CPU_OFFLOAD``)::

    forward:   y = mm(a, b)              # cached for backward like MUST_SAVE; group = [y],
                                         # its device-to-host copy starts at once
               ...                       # the rest of the region reads y meanwhile
               region exit               # y's storage is freed if only the cache holds it
    backward:  recompute of region k     # region k's groups back on the device (waited), the
                                         # host-to-device copies of the regions before it start
               mm in the recompute       # returns the cached y: the same tensor, data back

Note: [Offload tags in eager checkpointing]
    torch's own selective checkpointing caches outputs tagged ``*_SAVE`` and recomputes every
    other tag, ``*_CPU_OFFLOAD`` included. Here the caching mode caches an offload-tagged output
    as ``MUST_SAVE`` (torch's recompute returns it, never reruns the op) and hands it to a
    :class:`~swap_pass.runtime.group.SwapTensors` group: the runtime, streams, host pool and
    ``swap_stats()`` counters of every other way in. The copy out starts when the op returns; the
    storage is freed when the region's forward ends, once the copy is complete and only torch's
    cache holds it (Note: [Ownership rule] in ``swap_pass/runtime/freeing.py``). An output that
    cannot move (the region's own output, a view of a tensor outliving the region, an op that
    returns no tensor) stays saved on the device: under ``PREFER_CPU_OFFLOAD`` counted by reason
    (``swap_stats().skipped_bytes``), under ``MUST_CPU_OFFLOAD`` an error naming the op, raised
    once every group of the region is back on the device. Inside :func:`swap_pass.no_swap` both
    tags save on the device, counted under ``"no_swap"``. Under ``torch.compile`` the tags reach
    the joint graph as in torch; ``swap_backend`` honours them (``swap_pass/graph/sac_tags.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import checkpoint as _ckpt
from torch.utils._pytree import tree_leaves

from swap_pass import state
from swap_pass.config import SwapConfig, check_config
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime import register_reset_hook
from swap_pass.runtime.freeing import outside_holders
from swap_pass.runtime.group import DEVICE, HOST, SwapTensors, is_valid_for_swap
from swap_pass.runtime.stats import SkipReason, record_skip

__all__ = ["has_offload_policies", "offload_policies", "selective_checkpoint_contexts"]

_API = "selective_checkpoint_contexts"
_FIRST_RELEASE = "2.13"


def has_offload_policies() -> bool:
    """Whether this torch's ``CheckpointPolicy`` has ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``."""
    policy = getattr(_ckpt, "CheckpointPolicy", None)
    return all(hasattr(policy, name) for name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"))


def offload_policies(api: str = _API) -> tuple[Any, Any]:
    """``(MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD)`` of this torch.

    Raises:
        RuntimeError: this torch has no such members, naming the release that has them.
    """
    if not has_offload_policies():
        raise RuntimeError(
            f"swap_pass.{api}: torch {torch.__version__} has no "
            "torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD / PREFER_CPU_OFFLOAD. "
            f"Offload tags need torch {_FIRST_RELEASE} or later (2.15 has them too); with this "
            "torch, tag the ops MUST_SAVE, or swap layer inputs with "
            "swap_pass.enable_swap_layer_input."
        )
    policy = _ckpt.CheckpointPolicy
    return policy.MUST_CPU_OFFLOAD, policy.PREFER_CPU_OFFLOAD


# --- the groups of one checkpointed call -------------------------------------------------------


class _Offloaded:
    """One offloaded output: its op, tag and group, and its version when the copy out started."""

    __slots__ = ("op", "policy", "group", "version")

    def __init__(self, op: str, policy: Any, group: SwapTensors) -> None:
        self.op, self.policy, self.group = op, policy, group
        self.version = group.tensors[0]._version

    def written_since(self) -> bool:
        """Whether the region wrote the output in place after its copy out started
        (``allow_cache_entry_mutation=True``): the host copy is stale then."""
        return self.group.tensors[0]._version != self.version


class _Region:
    """The offloaded outputs of one checkpointed call, in op order (``must``: MUST_CPU_OFFLOAD)."""

    def __init__(self, config: SwapConfig, must: Any) -> None:
        self.config = config
        self.must = must
        self.entries: list[_Offloaded] = []

    def offer(self, func: Any, policy: Any, out: Any, cached: list[torch.Tensor]) -> None:
        """An op tagged ``policy`` returned ``out``, which torch cached as ``cached`` (one
        detached alias per tensor of ``out``): start the copy out of each."""
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not tensors:
            self._refuse(func, policy, None, SkipReason.OFFLOAD_FALLBACK, "returns no tensor")
        for t, alias in zip(tensors, cached, strict=True):
            reason, detail = _why_not(t)
            if reason is not None:
                self._refuse(func, policy, t, reason, detail)
            elif not self._holds(alias):
                self._start(func, policy, alias)

    def _holds(self, t: torch.Tensor) -> bool:
        key = t.untyped_storage()._cdata
        return any(e.group.tensors and e.group.tensors[0].untyped_storage()._cdata == key
                   for e in self.entries)

    def _start(self, func: Any, policy: Any, alias: torch.Tensor) -> None:
        """Group torch's cached alias, not the op's output: the output is the caller's tensor
        (the region may return it), a holder the ownership check must see."""
        group = SwapTensors([alias], config=self.config, name=f"the output of {func}")
        if group.is_empty:  # under SwapConfig.min_swap_bytes: counted by the group
            return
        group.swap_to_host()
        self.entries.append(_Offloaded(str(func), policy, group))

    def _refuse(self, func: Any, policy: Any, t: torch.Tensor | None, reason: SkipReason,
                detail: str) -> None:
        """Keep an output on the device: counted, or an error for ``MUST_CPU_OFFLOAD`` (after
        every group of the region is back on the device)."""
        if policy is self.must and reason is not SkipReason.NO_SWAP:
            self.abort()
            raise RuntimeError(
                f"swap_pass.{_API}: the output of {func} is tagged MUST_CPU_OFFLOAD but cannot "
                f"be swapped: it {detail}. A MUST_CPU_OFFLOAD output must be a tensor with a "
                "storage of its own that nothing outside the checkpointed region holds; tag it "
                "PREFER_CPU_OFFLOAD to keep it saved on the device when it cannot move, or "
                "MUST_SAVE."
            )
        nbytes = 0 if t is None else t.numel() * t.element_size()
        record_skip(reason, nbytes, where=f"{_API} ({func})", detail=f"It {detail}.")

    def finish_forward(self, cache: dict) -> None:
        """The region's forward ended: free each storage only the cache still holds."""
        for entry in list(self.entries):
            group = entry.group
            group.wait_copy_out()  # its source is no holder once the copy ran
            t = group.tensors[0]
            extra = outside_holders(_cached_aliases(cache, t.untyped_storage()._cdata))
            if extra <= 0 and not entry.written_since():
                group.wait_d2h()
                continue
            group.restore()
            self.entries.remove(entry)
            if extra > 0:
                self._refuse(entry.op, entry.policy, t, SkipReason.SHARED_STORAGE,
                             f"shares its storage with {extra} other live tensor(s), e.g. the "
                             "region's output or a tensor from outside the region")
            else:
                self._refuse(entry.op, entry.policy, t, SkipReason.OFFLOAD_FALLBACK,
                             "was written in place after it was made")
        if any(e.group.stat is HOST for e in self.entries):
            _forward_order.append(self)

    def restore(self) -> None:
        """Recompute begins: this region's data back on the device; prefetch the regions before
        it (``SwapConfig.prefetch_layers`` of them)."""
        for entry in self.entries:
            if entry.group.stat is not DEVICE:
                entry.group.restore()
        if self.config.prefetch:
            for region in _forward_order.before(self, self.config.prefetch_layers):
                region.prefetch()
        _forward_order.remove(self)

    def prefetch(self) -> None:
        """Start the host-to-device copies of this region's groups."""
        for entry in self.entries:
            if entry.group.stat is HOST:
                entry.group.swap_to_device()

    def abort(self) -> None:
        """Every group back on the device (an error in the region, or a refused MUST tag)."""
        for entry in self.entries:
            entry.group.restore()
        self.entries.clear()
        _forward_order.remove(self)


def _why_not(t: torch.Tensor) -> tuple[SkipReason | None, str]:
    """Why ``t`` cannot leave the device (``(None, "")`` when it can), said for the user."""
    if not swap_allowed():
        return SkipReason.NO_SWAP, "was made inside swap_pass.no_swap()"
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
        return SkipReason.NO_STORAGE, f"has no plain strided storage ({t.layout})"
    if type(t) is not torch.Tensor:
        return SkipReason.SUBCLASS, f"is a {type(t).__name__}"
    if not is_valid_for_swap(t):
        return SkipReason.NO_STORAGE, "has an empty storage"
    return None, ""


def _cached_tensors(entry: Any) -> list[torch.Tensor]:
    """The tensors of one cache entry of torch's (its leaves wrap them in ``.val``)."""
    vals = [getattr(leaf, "val", None) for leaf in tree_leaves(entry)]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def _cached_aliases(cache: dict, key: int) -> list[torch.Tensor]:
    """The tensors torch's selective-checkpoint cache holds over the storage ``key``."""
    found = []
    for per_op in cache.values():
        entries = per_op.values() if isinstance(per_op, dict) else per_op
        for entry in entries:
            found += [t for t in _cached_tensors(entry) if t.untyped_storage()._cdata == key]
    return found


class _ForwardOrder:
    """Regions whose data is on the host, in the order their forwards ended (weakly held): the
    ones recomputed next in backward are the ones just before."""

    def __init__(self) -> None:
        self._lock = state.forward_order_lock
        self._regions: list[weakref.ref[_Region]] = state.forward_order

    def append(self, region: _Region) -> None:
        with self._lock:
            self._regions[:] = [r for r in self._regions if r() is not None]
            self._regions.append(weakref.ref(region))

    def before(self, region: _Region, count: int) -> list[_Region]:
        with self._lock:
            live = [r() for r in self._regions]
        if region not in live:
            return []
        idx = live.index(region)
        return [r for r in reversed(live[max(idx - count, 0):idx]) if r is not None]

    def remove(self, region: _Region) -> None:
        with self._lock:
            self._regions[:] = [r for r in self._regions if r() is not None and r() is not region]

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()


_forward_order = _ForwardOrder()
register_reset_hook(_forward_order.clear)


# --- the two dispatch modes --------------------------------------------------------------------


class _TaggingPolicy:
    """The user's policy as torch's caching mode asks it: offload tags become ``MUST_SAVE``
    outside compile, and the call's tag is kept in :attr:`offered` for the mode to read."""

    def __init__(self, policy_fn: Callable, policies: tuple[Any, Any]) -> None:
        self.policy_fn = policy_fn
        self.offload = policies
        self.offered: tuple[Any, Any] | None = None

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy_fn(ctx, func, *args, **kwargs)
        if policy in self.offload and not _traced(ctx, func, args, kwargs):
            self.offered = (func, policy)
            return _ckpt.CheckpointPolicy.MUST_SAVE
        return policy  # under compile the tag reaches the graph as it is


def _traced(ctx: Any, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op runs under tracing: AOTAutograd's (a proxy mode), or Dynamo's fake run of
    the checkpointed body (fake outputs), where torch's own handling of the tags applies."""
    if _ckpt._is_compiling(func, args, kwargs):
        return True
    from torch._subclasses.fake_tensor import is_fake

    out = getattr(ctx, "op_output", None)
    return any(is_fake(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class _OffloadCaching(_ckpt._CachingTorchDispatchMode):
    """torch's caching mode, with offload-tagged outputs cached and swapped (Note: [Offload tags
    in eager checkpointing])."""

    def __init__(self, policy: _TaggingPolicy, storage: dict, region: _Region) -> None:
        super().__init__(policy, storage)  # no reference back to the mode: no cycle to collect
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        policy = self.policy_fn
        policy.offered = None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if policy.offered is not None:
            (op, tag), policy.offered = policy.offered, None
            self.region.offer(op, tag, out, _cached_tensors(self._last_entry(func, args)))
        return out

    def __exit__(self, exc_type, exc_value, traceback):
        result = super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:
            self.region.finish_forward(self.storage)
        else:
            self.region.abort()
        return result

    def _last_entry(self, func: Any, args: tuple) -> Any:
        """The cache entry torch made for this call (keyed by op, then by call index)."""
        key = _ckpt._sac_storage_key(func, args) if hasattr(_ckpt, "_sac_storage_key") else func
        per_op = self.storage[key]
        return per_op[self.func_counter[key] - 1] if isinstance(per_op, dict) else per_op[-1]


class _OffloadCached(_ckpt._CachedTorchDispatchMode):
    """torch's recompute mode; the region's swapped outputs are back on the device first."""

    def __init__(self, storage: dict, region: _Region, allow_cache_entry_mutation: bool) -> None:
        super().__init__(None, storage, allow_cache_entry_mutation)
        self.region = region

    def __enter__(self):
        self.region.restore()
        return super().__enter__()


def _as_policy_fn(policy_fn_or_list: Callable | Sequence) -> Callable:
    """A policy function for torch's list form (listed ops ``MUST_SAVE``), or the function."""
    if callable(policy_fn_or_list):
        return policy_fn_or_list
    if isinstance(policy_fn_or_list, (list, tuple)):
        ops = list(policy_fn_or_list)
        _ckpt.create_selective_checkpoint_contexts(ops)  # torch's own checks of the list

        def policy_fn(ctx, op, *args, **kwargs):
            policy = _ckpt.CheckpointPolicy
            return policy.MUST_SAVE if op in ops else policy.PREFER_RECOMPUTE

        return policy_fn
    raise TypeError(
        f"swap_pass.{_API}: policy_fn_or_list is a {type(policy_fn_or_list).__name__}. It must "
        "be a policy function (ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list of ops."
    )


def selective_checkpoint_contexts(policy_fn_or_list: Callable | Sequence,
                                  allow_cache_entry_mutation: bool = False, *,
                                  config: SwapConfig | None = None) -> tuple[Any, Any]:
    """torch's ``create_selective_checkpoint_contexts``, with ``*_CPU_OFFLOAD`` tags swapped.

    Use it as ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``::

        context_fn = functools.partial(swap_pass.selective_checkpoint_contexts, policy_fn)

    Outputs tagged ``MUST_CPU_OFFLOAD`` or ``PREFER_CPU_OFFLOAD`` are saved and swapped to
    host memory (Note: [Offload tags in eager checkpointing]); every other tag behaves as in
    torch. Gradients are bitwise those of the same model without checkpointing.

    Args:
        policy_fn_or_list: A policy ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or
            bool), or a list of ops to save, as for torch's function.
        allow_cache_entry_mutation: As for torch's function. Default: ``False``.
        config: Runtime knobs of the swapped outputs (``prefetch``, ``prefetch_layers``,
            ``min_swap_bytes``, host cap). Default: ``SwapConfig()``.

    Returns:
        The forward and recompute contexts, a pair of ``TorchDispatchMode`` as torch's.

    Raises:
        RuntimeError: This torch has no offload tags (naming the release that has them), or an
            output tagged ``MUST_CPU_OFFLOAD`` cannot be swapped in the forward (naming the op).
        TypeError: ``policy_fn_or_list`` or ``config`` is of the wrong type.
    """
    policies = offload_policies()
    policy_fn = _as_policy_fn(policy_fn_or_list)
    config = check_config(config, _API)
    region = _Region(config, policies[0])
    storage: dict = _new_storage()
    return (_OffloadCaching(_TaggingPolicy(policy_fn, policies), storage, region),
            _OffloadCached(storage, region, allow_cache_entry_mutation))


def _new_storage() -> dict:
    """The cache dict torch's two modes share (its own layout: a ``defaultdict``)."""
    caching, _ = _ckpt.create_selective_checkpoint_contexts(lambda *a, **k: False)
    return caching.storage
