"""``SmartSwap``: profile, plan and swap saved activations under a memory budget, in eager mode.

::

    with SmartSwap(model, memory_budget=0.25) as smart:   # bytes, or a fraction of the saved peak
        for batch in data:
            loss = model(*batch); loss.backward(); opt.step(); opt.zero_grad()
            smart.step()                                   # stage machine advances here

Steps run in one of three stages (``smart.stage``; history in ``smart.stage_log``): ``warmup``
and ``gen_policy`` swap conservatively (every eligible activation leaves once only autograd
holds it: memory stays bounded without a plan), ``gen_policy`` records the detailed profile
``smart.policy`` is built from, and ``stable`` follows it, checking each step's signature.

Plans are cached by signature (``SmartSwapConfig.plan_cache_size``): a stable step switches to
a cached plan of its shape at its first changed saved tensor, a new length of the same structure
runs the plan of the nearest longer one, and a step with no plan records a profile, planned at
``step()``. So after the first plan no step re-profiles (``plan_cache_size=0``: at every change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from swap_pass.config import SwapConfig, check_config
from swap_pass.cost.model import FORWARD_SHARE
from swap_pass.cost.probes import measure_copy_bandwidth
from swap_pass.opt_out import ModuleFilter, check_module_filter
from swap_pass.runtime import register_reset_hook
from swap_pass.smart.executor import SmartExecutor
from swap_pass.smart.policy import PlanCache, SwapPolicy, gen_policy, replay_peak
from swap_pass.smart.profiler import (
    DetailedProfile,
    FeatureTracker,
    now,
    sequence_distance,
    state_storage_ptrs,
)
from swap_pass.smart.reports import (
    MicroBatchReport,
    Stage,
    StageController,
    StageEvent,
    StepReport,
)
from swap_pass.state import active_smart_swaps as _active

__all__ = ["SmartSwap", "SmartSwapConfig"]


@dataclasses.dataclass(frozen=True)
class SmartSwapConfig:
    """Knobs of :class:`SmartSwap`.

    Args:
        warmup_steps: Steps before the first detailed profile. Default: ``1``.
        num_groups: Logical layers the policy cuts the saved sequence into. Default: ``8``.
        min_swap_bytes: Storages smaller than this stay on the device. Default: ``1024``.
        signature_threshold: Signature distance (0..1, 1 - difflib ratio of the key sequences)
            above which a stable plan is re-made; at or below, fuzzy matching absorbs the
            change. Default: ``0.1``.
        match_window: How far ahead of the cursor a live tensor may match a plan entry.
            Default: ``64``.
        miss_limit: Consecutive unmatched tensors after which a planned step turns
            conservative for the rest of the step. Default: ``8``.
        max_prefetch_depth: Deepest prefetch (in groups) the policy tries. Default: ``4``.
        fwd_fraction: Share of compute spent in forward, for the simulator. Default: ``1/3``
            (:data:`~swap_pass.cost.model.FORWARD_SHARE`).
        d2h_bandwidth: Bytes/s; measured on first need when None. Default: ``None``.
        h2d_bandwidth: Bytes/s; the measured d2h figure when None. Default: ``None``.
        callsite_depth: Depth of the modules whose name is the call-site feature (``2``:
            ``"layers.1"``); ``None`` for every module. Default: ``2``.
        plan_cache_size: Plans kept, one per operator sequence, least recently used dropped
            first; ``0`` keeps only the current one, re-profiling at every change. Default: ``8``.
        d2h_overlap_groups: Most logical layers a device-to-host copy runs before the forward
            waits for it and frees its storage (the longest that fits the budget). Default: ``2``.
        swap: Runtime knobs (host cap, streams, pinning) for the groups. Default: ``SwapConfig()``.
    """

    warmup_steps: int = 1
    num_groups: int = 8
    min_swap_bytes: int = 1024
    signature_threshold: float = 0.1
    match_window: int = 64
    miss_limit: int = 8
    max_prefetch_depth: int = 4
    fwd_fraction: float = FORWARD_SHARE
    d2h_bandwidth: float | None = None
    h2d_bandwidth: float | None = None
    callsite_depth: int | None = 2
    plan_cache_size: int = 8
    d2h_overlap_groups: int = 2
    swap: SwapConfig = dataclasses.field(default_factory=SwapConfig)

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "min_swap_bytes", "max_prefetch_depth", "plan_cache_size",
                     "d2h_overlap_groups"):
            _check(name, getattr(self, name), getattr(self, name) >= 0, ">= 0")
        for name in ("num_groups", "match_window", "miss_limit"):
            _check(name, getattr(self, name), getattr(self, name) >= 1, ">= 1")
        _check("signature_threshold", self.signature_threshold,
               0 <= self.signature_threshold <= 1, "in [0, 1]")
        _check("fwd_fraction", self.fwd_fraction, 0 < self.fwd_fraction < 1, "in (0, 1)")
        for name in ("d2h_bandwidth", "h2d_bandwidth"):
            v = getattr(self, name)
            _check(name, v, v is None or v > 0, "None or > 0")
        check_config(self.swap, "SmartSwapConfig.swap")


def _check(name: str, value, ok: bool, must: str) -> None:
    if not ok:
        raise ValueError(f"swap_pass.SmartSwapConfig: {name}={value!r} is invalid. "
                         f"It must be {must}.")


@register_reset_hook
def _reset_active() -> None:
    """:func:`swap_pass.reset` keeps an active SmartSwap working: its hooks, stage, profile and
    plan stay; what it swapped is brought back by the reset like any group."""
    for smart in list(_active):
        smart._executor.forget_pending()


def _left_out(model: nn.Module, module_filter_fn) -> Callable[[str], bool]:
    """``fqn -> bool``: whether ``module_filter_fn`` refuses the module ``fqn`` or a parent of it
    (asked once per name)."""
    @functools.lru_cache(maxsize=None)
    def refused(fqn: str) -> bool:
        if fqn and refused(fqn.rpartition(".")[0]):
            return True
        return not module_filter_fn(model.get_submodule(fqn), fqn)

    return refused


class SmartSwap:
    """Adaptive swapping of saved activations under a memory budget (context manager).

    Args:
        model: The model; its parameters and buffers are never swapped, and its modules give
            the call-site feature.
        memory_budget: Resident saved-activation bytes allowed (``int``), or a fraction in
            ``(0, 1]`` of the unswapped saved-activation peak measured by the detailed profile.
        config: :class:`SmartSwapConfig`, or a :class:`~swap_pass.SwapConfig` for the runtime
            knobs alone. Default: ``SmartSwapConfig()``.
        module_filter_fn: ``(module, fqn) -> bool``; a tensor saved while a module it returns
            False for runs (that module, or one inside it down to ``callsite_depth``) stays with
            autograd, counted under ``SkipReason.MODULE_FILTER``. Default: ``None`` (all).

    Attributes:
        stage: ``"warmup"``, ``"gen_policy"`` or ``"stable"`` (the stage of the coming step).
        stage_log: :class:`StageEvent` per transition or absorbed change.
        policy: The current :class:`SwapPolicy`, or None before the first plan.
        last_profile: The latest :class:`DetailedProfile`.
        last_report: The :class:`StepReport` of the latest step.
        steps: Steps completed (calls to :meth:`step`).
        plan_cache: The :class:`~swap_pass.smart.policy.PlanCache` (``hits``, ``misses``,
            ``evictions``, ``derived``), or None with ``plan_cache_size=0``.

    Raises:
        RuntimeError: on entering inside another active ``SmartSwap`` (saved-tensor hooks do
            not nest per model: only the innermost would run).
    """

    def __init__(self, model: nn.Module, *, memory_budget: int | float,
                 config: SmartSwapConfig | SwapConfig | None = None,
                 module_filter_fn: ModuleFilter = None) -> None:
        if isinstance(config, SwapConfig):
            config = SmartSwapConfig(swap=config)
        if config is not None and not isinstance(config, SmartSwapConfig):
            check_config(config, "SmartSwap", "SmartSwapConfig or a swap_pass.SwapConfig")
        self.config = config = config or SmartSwapConfig()
        _check_budget(memory_budget)
        self.model = model
        self.memory_budget = memory_budget
        check_module_filter(module_filter_fn, "SmartSwap")
        self._controller = StageController(config.warmup_steps, config.signature_threshold)
        size = config.plan_cache_size
        self.plan_cache = PlanCache(size, config.signature_threshold) if size else None
        # The module hooks come and go with `with smart:` (attach / remove), the tracker stays.
        self._tracker = FeatureTracker(model, config.callsite_depth, attach=False)
        self._executor = SmartExecutor(
            config.swap, call_sites=self._tracker, plan_cache=self.plan_cache,
            min_swap_bytes=config.min_swap_bytes, match_window=config.match_window,
            miss_limit=config.miss_limit, where=f"SmartSwap({type(model).__name__})",
            left_out=None if module_filter_fn is None else _left_out(model, module_filter_fn))
        self._tracker.post_forward_callbacks.append(self._executor.poll)
        self.policy: SwapPolicy | None = None
        self.last_profile: DetailedProfile | None = None
        self.last_report: StepReport | None = None
        self.steps = 0
        self._absorbed: set[int] = set()
        self._bandwidth: tuple[float, float] | None = None
        self._hooks = None
        self._warned_infeasible = False

    # --- public -------------------------------------------------------------------------------

    @property
    def stage(self) -> Stage:
        """Stage of the coming step."""
        return self._controller.stage

    @property
    def stage_log(self) -> list[StageEvent]:
        """Every stage transition (and absorbed small change), oldest first."""
        return list(self._controller.log)

    @property
    def replans(self) -> int:
        """How many times a stable plan was dropped for a new one."""
        return self._controller.replans

    def __repr__(self) -> str:
        return (f"SmartSwap(model={type(self.model).__name__}, memory_budget={self.memory_budget}, "
                f"stage={self.stage.value!r}, steps={self.steps}, policy={self.policy!r})")

    def __enter__(self) -> SmartSwap:
        if self._hooks is not None:
            raise RuntimeError("swap_pass.SmartSwap: entered twice. "
                               "It must be entered once at a time.")
        if _active:
            raise RuntimeError(
                f"swap_pass.SmartSwap: entered inside another SmartSwap (over "
                f"{type(_active[-1].model).__name__}). Saved-tensor hooks do not nest per model: "
                "only the innermost would run and the outer one would record nothing. One "
                "SmartSwap must be active at a time; give it one module that holds both models."
            )
        try:  # Note: [Entering and leaving as one transaction]
            state_storage_ptrs(self.model)  # fails here, before any hook, if it cannot be read
            self._tracker.attach()
            hooks = torch.autograd.graph.saved_tensors_hooks(self._executor.pack,
                                                             self._executor.unpack)
            hooks.__enter__()  # raises inside torch.autograd.graph.disable_saved_tensors_hooks
            self._hooks = hooks
            _active.append(self)
            self._begin()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook. Tensors already saved keep working (their unpack still restores).

        Note: [Entering and leaving as one transaction]
        ``__enter__`` adds module hooks, then saved-tensor hooks, then registers the instance as
        active; a failure anywhere (inside ``disable_saved_tensors_hooks``, unreadable model
        state) undoes it all, leaving model and process as before for a later ``with smart:``.
        ``close`` undoes each part even when another fails, then re-raises the first failure.
        """
        errors = []
        for undo in (self._pop_hooks, self._remove_tracker, self._deactivate):
            try:
                undo()
            except Exception as e:  # the other parts are still undone
                errors.append(e)
        if errors:
            raise errors[0]

    def _pop_hooks(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def _remove_tracker(self) -> None:
        self._tracker.remove()

    def _deactivate(self) -> None:
        if self in _active:
            _active.remove(self)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let tensors saved inside leave SmartSwap alone (another model's forward, say).

        SmartSwap's saved-tensor hooks apply to every autograd graph built while it is active,
        not only its model's. Inside ``paused()`` they are off; tensors saved earlier still
        restore at backward. A no-op outside ``with SmartSwap(...)``.

        Raises:
            RuntimeError: other saved-tensor hooks entered after SmartSwap are still active (the
                hooks form a stack: only the top one can be suspended).
        """
        hooks = self._hooks
        if hooks is None:
            yield
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] is not hooks.pack_hook:
            raise RuntimeError(
                "swap_pass.SmartSwap.paused: other saved-tensor hooks were entered after this "
                "SmartSwap and are still active. Pause SmartSwap outside them (the hooks form "
                "a stack: only the top one can be suspended)."
            )
        hooks.__exit__(None, None, None)
        try:
            yield
        finally:
            hooks.__enter__()

    def step(self) -> Stage:
        """Close the step (after backward and the optimizer step); return the next step's stage.

        A step that saved nothing for backward (evaluation, ``no_grad``) neither counts toward
        warmup nor changes the plan.
        """
        report = self._executor.end_step(now() - self._t0)
        self.last_report = report
        if not report.keys:  # nothing saved (eval, no_grad): no evidence either way
            self._begin()
            return self.stage
        built, distance = False, None
        if self.stage == Stage.GEN_POLICY:
            self.last_profile = report.profile
            self.policy = self._plan(report.profile)
            if self.plan_cache is not None:
                self.plan_cache.put(self.policy)
            self._absorbed.clear()
            built = True
        elif self.stage == Stage.STABLE and self.plan_cache is not None:
            for unit in report.units:
                self._settle(unit)
        elif self.stage == Stage.STABLE:
            distance = self._distance(report)
        self._controller.end_step(self.steps, policy_built=built, distance=distance)
        self.steps += 1
        self._begin()
        return self.stage

    # --- internals ----------------------------------------------------------------------------

    def _begin(self) -> None:
        self._tracker.reset()
        stage = self.stage
        self._executor.begin_step(stage, self.policy if stage == Stage.STABLE else None,
                                  state_storage_ptrs(self.model))
        self._t0 = now()

    def _settle(self, unit: MicroBatchReport) -> None:
        """After a stable micro-batch: log how its plan was found, or make one from its profile."""
        if not unit.keys:
            return
        cache, signature = self.plan_cache, hash(tuple(unit.keys))
        found = cache.find(signature, unit.keys)
        if unit.by_structure and not unit.fell_back:
            cache.derived += 1
        if found is not None:
            plan, distance = found
            if unit.switched and not unit.by_structure and unit.plan is plan:
                cache.hits += 1
                self._note(f"plan cache hit: ran the plan cached for this sequence "
                           f"({len(plan.keys)} saved tensors) from its first step")
            elif distance > 0 and signature not in self._absorbed:
                self._absorbed.add(signature)
                self._note(f"small change absorbed: distance {distance:.3f} <= "
                           f"{self.config.signature_threshold:.3f}")
        elif unit.profile is not None:
            cache.misses += 1
            evictions = cache.evictions
            plan = self._plan(unit.profile)
            cache.put(plan)
            how = ("ran the plan of a longer sequence of the same structure" if unit.by_structure
                   and not unit.fell_back else "fell back to conservative" if unit.fell_back
                   else "ran the plan in force")
            self._note(f"plan cache miss: {how}; planned from this step's profile "
                       f"({cache.evictions - evictions} evicted)")
            found = (plan, 0.0)
        if found is not None:
            self.policy = found[0]

    def _note(self, reason: str) -> None:
        self._controller.note(self.steps, reason)

    def _distance(self, report: StepReport) -> float | None:
        if report.signature == self.policy.signature or report.signature in self._absorbed:
            return None
        distance = sequence_distance(report.keys, self.policy.keys)
        if distance <= self.config.signature_threshold:
            self._absorbed.add(report.signature)
        return distance

    def _plan(self, profile: DetailedProfile) -> SwapPolicy:
        d2h, h2d = self._bandwidths()
        c = self.config
        policy = gen_policy(profile, self._budget_bytes(profile), num_groups=c.num_groups,
                            min_swap_bytes=c.min_swap_bytes,
                            max_prefetch_depth=c.max_prefetch_depth,
                            fwd_fraction=c.fwd_fraction, d2h_bandwidth=d2h, h2d_bandwidth=h2d,
                            max_overlap_groups=c.d2h_overlap_groups)
        if not policy.feasible and not self._warned_infeasible:
            self._warned_infeasible = True
            warnings.warn(_infeasible_message(self.memory_budget, policy), RuntimeWarning,
                          stacklevel=3)
        return policy

    def _budget_bytes(self, profile: DetailedProfile) -> int:
        if isinstance(self.memory_budget, float):
            return int(self.memory_budget * replay_peak(profile, set(), 0, 1)[0])
        return int(self.memory_budget)

    def _bandwidths(self) -> tuple[float, float]:
        if self._bandwidth is None:
            c = self.config
            d2h = c.d2h_bandwidth
            if d2h is None:
                device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
                d2h = measure_copy_bandwidth(device)
            self._bandwidth = (d2h, c.h2d_bandwidth or d2h)
        return self._bandwidth


def _infeasible_message(budget: int | float, policy: SwapPolicy) -> str:
    asked = f"{budget} B" if isinstance(budget, int) else f"{budget} ({policy.budget_bytes} B here)"
    return (
        f"swap_pass.SmartSwap: memory_budget={asked} cannot be met: the best reachable peak of "
        f"saved activations is {policy.predicted_peak} B (unswapped {policy.unswapped_peak} B): "
        f"{policy.unreachable}. SmartSwap runs the plan that lowers every other tick as far as "
        f"it can (it moves {policy.swap_bytes} B); smart.policy.feasible is False and "
        "smart.policy.summary() repeats this. Warned once."
    )


def _check_budget(budget) -> None:
    ok = (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0) or (
        isinstance(budget, float) and 0 < budget <= 1)
    if not ok:
        raise ValueError(
            f"swap_pass.SmartSwap: memory_budget={budget!r} is invalid. It must be an int of "
            "bytes >= 0 or a float fraction in (0, 1] of the unswapped saved-activation peak."
        )
