"""SmartSwap's benchmark rows for ``swap-pass bench``, and an independent resident-bytes counter.

* :func:`profiler_overhead_rows`: the lightweight profiler's step-time ratio against no
  profiler and against ``torch.profiler`` on the same model (the issue asks for <= 3%).
* :func:`budget_rows`: peak resident saved bytes under SmartSwap against the budget, measured by
  :class:`ResidentSavedBytes`, which reads storage sizes and not SmartSwap's bookkeeping.
* :func:`dynamic_rows`: a schedule of sequence lengths drawn at random, with and without the
  plan cache: planned / conservative / profiling steps, peak against each length's budget, and
  step time against the same model without SmartSwap.

Rows are plain dicts so that the CLI can print them as a table or JSON.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
import weakref

import torch
from torch import nn

from swap_pass import SkipReason, SmartSwap, SmartSwapConfig, is_valid_for_swap
from swap_pass.runtime.freeing import in_backward
from swap_pass.smart import Stage
from swap_pass.smart.profiler import FeatureTracker, now, state_storage_ptrs
from swap_pass.smart.saved import local_of
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

__all__ = ["BENCH_CONFIG", "ResidentSavedBytes", "budget_rows", "dynamic_rows", "length_schedule",
           "profiler_overhead_rows", "step_kind"]

BENCH_CONFIG = LlamaConfig(hidden_size=256, num_layers=4, num_heads=8, intermediate_size=704)


class LightweightProfiler:
    """The lightweight profiler alone: keys and signature per step, nothing swapped.

    SmartSwap runs the same feature code inside its executor; this class exists so that its cost
    can be measured apart (:func:`profiler_overhead_rows`).

    Args:
        model: The model to watch.
        callsite_depth: See :class:`FeatureTracker`. Default: ``2``.
    """

    def __init__(self, model: nn.Module, callsite_depth: int | None = 2) -> None:
        self.model = model
        self.callsite_depth = callsite_depth
        self.keys: list[int] = []
        self.signatures: list[int] = []
        self._tracker: FeatureTracker | None = None
        self._hooks = None
        self._state: set[int] = set()

    def __enter__(self) -> LightweightProfiler:
        self._tracker = FeatureTracker(self.model, self.callsite_depth)
        self._state = state_storage_ptrs(self.model)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._tracker.remove()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        fn = t.grad_fn  # feature_key and state_key, inlined: this is the hot path
        local = local_of(t)
        if type(local) is SkipReason:  # no plain storage: never model state, never moved
            return t
        is_state = fn is None and local.untyped_storage().data_ptr() in self._state
        self.keys.append(hash(("leaf" if fn is None else type(fn).__name__,
                               self._tracker._stack[-1], t.dtype, t.shape, is_state)))
        return t

    def step(self) -> int:
        """Close the step: return its signature and start a new key sequence."""
        sig = hash(tuple(self.keys))
        self.signatures.append(sig)
        self.keys = []
        return sig


def _identity(x):
    return x


class ResidentSavedBytes:
    """Peak bytes of saved activation storages resident, read from the storages themselves.

    Enter it inside whatever saved-tensor hooks are active (SmartSwap's, or none): it passes
    every pack and unpack through to them, keeps weak references to the storages packed (model
    parameters and buffers, views of parameters, and tensors without one plain storage excluded;
    a ``DTensor``'s local storage counted) and after each pack and around each unpack sums the
    ``untyped_storage().nbytes()`` (a swapped-out storage reads 0) of those that autograd still
    holds a saved tensor of. A storage whose saved tensors autograd has all let go of (their
    node's backward ran) no longer counts, even while it lives on: a pipeline stage's receive
    buffer, say, kept for the next step after its micro-batch's backward. Tensors saved while
    the autograd engine runs (a reentrant checkpoint's recompute inside backward, which SmartSwap
    leaves to autograd) are passed through and not counted: the figure is of what the forward
    saved.

    Args:
        model: Whose parameters and buffers are not activations.
    """

    def __init__(self, model: nn.Module) -> None:
        self.state = state_storage_ptrs(model)
        self.storages: dict[int, weakref.ref] = {}
        self.saved: dict[int, list[weakref.ref]] = {}  # storage -> its packs autograd holds
        self.peak = 0
        self._hooks = None

    def __enter__(self) -> ResidentSavedBytes:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (_identity, _identity)

        def counted_pack(t):
            packed = _Packed(None)
            local = local_of(t)  # a DTensor's local tensor; sparse, nested: not counted
            # no parameter views, nothing saved by a recompute inside backward
            if not in_backward() and type(local) is not SkipReason and is_valid_for_swap(local):
                storage = local.untyped_storage()
                if storage.data_ptr() not in self.state:
                    self.storages[storage._cdata] = weakref.ref(storage)
                    self.saved.setdefault(storage._cdata, []).append(weakref.ref(packed))
                del storage
            packed.handle = pack(t)
            self.sample()
            return packed

        def counted_unpack(packed):
            self.sample()
            t = unpack(packed.handle)
            self.sample()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(counted_pack, counted_unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def resident(self) -> int:
        """Bytes of the packed storages now allocated that autograd still holds saved."""
        total = 0
        for key, ref in self.storages.items():
            storage = ref()
            if storage is not None and any(p() is not None for p in self.saved[key]):
                total += storage.nbytes()
        return total

    def sample(self) -> int:
        """Read :meth:`resident` and keep the peak."""
        value = self.resident()
        self.peak = max(self.peak, value)
        return value


class _Packed:
    """What :class:`ResidentSavedBytes` hands autograd: the inner hooks' handle; it lives as long
    as autograd holds the saved tensor."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, handle) -> None:
        self.handle = handle


def _train_step(model: LlamaStyleModel, batch) -> None:
    model(*batch).backward()
    model.zero_grad(set_to_none=True)


_CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _interleaved(variants: dict, steps: int, clock: str) -> dict[str, list[float]]:
    """Seconds of each step per variant. Variants take turns step by step in a rotating order,
    so that load drifting on a shared machine hits them alike; each variant's context is
    entered and left around its own step, outside the timed region. A variant is
    ``(context factory, step fn)``."""
    tick = _CLOCKS[clock]
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            make_ctx, run = variants[name]
            with make_ctx() as ctx:
                t0 = tick()
                run(ctx)
                times[name].append(tick() - t0)
    return times


def _median_ratio(a: list[float], b: list[float]) -> float:
    """Median over turns of a[i] / b[i]: paired, so slow drifts cancel."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _torch_profiler():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=True)


def profiler_overhead_rows(cfg: LlamaConfig = BENCH_CONFIG, *, batch: int = 2, seq: int = 256,
                           steps: int = 60, clock: str = "cpu", threads: int | None = 1,
                           seed: int = 0) -> list[dict]:
    """Step time with SmartSwap's lightweight profiler, with ``torch.profiler``, and with neither.

    Args:
        cfg: Model sizes. Default: :data:`BENCH_CONFIG`.
        batch: Sequences per step. Default: ``2``.
        seq: Tokens per sequence. Default: ``256``.
        steps: Timed steps per variant. Default: ``60``.
        clock: ``"cpu"`` (process CPU time: robust when other processes share the cores) or
            ``"wall"``. Default: ``"cpu"``.
        threads: Intra-op threads during the run (restored after); ``1`` keeps OpenMP
            spin-waits out of the CPU time. ``None`` leaves torch's setting. Default: ``1``.
        seed: Weights and batch seed. Default: ``0``.

    Returns:
        One row per variant: ``name``, ``step_ms`` (median), ``ratio_vs_none`` and
        ``ratio_vs_torch_profiler`` (medians over turns of the paired step-time ratios).
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _overhead_rows(cfg, batch, seq, steps, clock, seed)
    finally:
        torch.set_num_threads(before)


def _overhead_rows(cfg, batch, seq, steps, clock, seed) -> list[dict]:
    torch.manual_seed(seed)
    model = LlamaStyleModel(cfg)
    data = make_batch(cfg, batch, seq, seed=seed)
    _train_step(model, data)  # warm up allocator and kernels

    def lightweight_step(prof):
        _train_step(model, data)
        prof.step()

    variants = {
        "none": (_null_ctx, lambda _: _train_step(model, data)),
        "smart.lightweight_profiler": (lambda: LightweightProfiler(model), lightweight_step),
        "torch.profiler(record_shapes)": (_torch_profiler, lambda _: _train_step(model, data)),
    }
    times = _interleaved(variants, steps, clock)
    none, tp = times["none"], times["torch.profiler(record_shapes)"]
    return [{"name": name, "clock": clock, "step_ms": round(statistics.median(ts) * 1e3, 3),
             "ratio_vs_none": round(_median_ratio(ts, none), 4),
             "ratio_vs_torch_profiler": round(_median_ratio(ts, tp), 4)}
            for name, ts in times.items()]


def _null_ctx():
    import contextlib
    return contextlib.nullcontext()


def budget_rows(cfg: LlamaConfig = BENCH_CONFIG, *, batch: int = 2, seq: int = 256,
                fraction: float = 0.25, steps: int = 5, seed: int = 0,
                change_seq: int | None = None, change_steps: int = 2) -> list[dict]:
    """Peak resident saved bytes under SmartSwap against a budget of ``fraction`` x the
    unswapped peak.

    Args:
        change_seq: When given, ``change_steps`` more steps run at this sequence length after
            the ``steps`` at ``seq``: the first is the change step (old plan, fallback), the
            next re-profiles. The budget (bytes) stays the one set from ``seq``.
            Default: ``None``.
        change_steps: Steps at ``change_seq``. Default: ``2``.

    Returns:
        One row per step: ``step``, ``seq``, ``stage``, ``fell_back``, ``peak_bytes``
        (independent counter), ``budget_bytes``, ``within_budget``, ``swapped_bytes``,
        ``step_ms``; and a first row ``name="no swap"`` with the unswapped peak.
    """
    torch.manual_seed(seed)
    model = LlamaStyleModel(cfg)
    data = make_batch(cfg, batch, seq, seed=seed)
    with ResidentSavedBytes(model) as counter:
        model(*data).backward()
    model.zero_grad(set_to_none=True)
    peak0 = counter.peak
    budget = int(fraction * peak0)
    rows = [{"name": "no swap", "peak_bytes": peak0}]
    schedule = [(seq, data)] * steps
    if change_seq is not None:
        schedule += [(change_seq, make_batch(cfg, batch, change_seq, seed=seed))] * change_steps
    with SmartSwap(model, memory_budget=budget) as smart:
        for step, (n, batch_data) in enumerate(schedule):
            stage = smart.stage.value
            t0 = now()
            with ResidentSavedBytes(model) as counter:
                _train_step(model, batch_data)
            smart.step()
            report = smart.last_report
            rows.append({"name": "smartswap", "step": step, "seq": n, "stage": stage,
                         "fell_back": report.fell_back, "peak_bytes": counter.peak,
                         "budget_bytes": budget, "within_budget": counter.peak <= budget,
                         "swapped_bytes": report.swapped_bytes,
                         "step_ms": round((now() - t0) * 1e3, 3)})
    return rows


def length_schedule(lengths: tuple[int, ...], steps: int, seed: int = 0) -> list[int]:
    """``steps`` sequence lengths drawn uniformly from ``lengths`` (seeded)."""
    rng = random.Random(seed)
    return [rng.choice(lengths) for _ in range(steps)]


def step_kind(stage: Stage, report) -> str:
    """``"profiling"`` (detailed profiler), ``"conservative"`` (warmup, or fell back mid-step)
    or ``"planned"`` (ran a plan to its end)."""
    if stage == Stage.GEN_POLICY:
        return "profiling"
    if stage == Stage.WARMUP or report.fell_back:
        return "conservative"
    return "planned"


def dynamic_rows(cfg: LlamaConfig = BENCH_CONFIG, *, batch: int = 2,
                 lengths: tuple[int, ...] = (128, 160, 192, 224, 256), steps: int = 50,
                 fraction: float = 0.25, seed: int = 0, threads: int | None = 1) -> list[dict]:
    """A varying-length schedule under SmartSwap, with the plan cache and without it.

    Each step draws its sequence length from ``lengths``; its budget is ``fraction`` x the
    unswapped peak at that length (measured by :class:`ResidentSavedBytes`). Every step also
    runs on an unswapped copy of the model, right before, for the step-time ratio.

    Args:
        cfg: Model sizes. Default: :data:`BENCH_CONFIG`.
        batch: Sequences per step. Default: ``2``.
        lengths: The lengths drawn from. Default: ``(128, 160, 192, 224, 256)``.
        steps: Steps per variant. Default: ``50``.
        fraction: Budget per length, of its unswapped peak. Default: ``0.25``.
        seed: Weights, batches and schedule. Default: ``0``.
        threads: Intra-op threads during the run (restored after). Default: ``1``.

    Returns:
        One row per variant (``plan_cache_size`` 8 and 0): ``planned``, ``conservative``,
        ``profiling`` step counts; ``over_budget`` (planned steps whose peak passed the
        budget); ``max_peak_over_budget`` and ``peak_over_budget`` (per step, peak / budget);
        ``kinds`` (one letter per step: ``p`` planned, ``c`` conservative, ``P`` profiling);
        ``step_ms`` and ``plain_step_ms`` (medians, CPU time) and ``ratio_vs_none`` (median
        of the per-step ratios), ``cache`` (hits, misses, evictions, derived);
        ``d2h_copies`` of planned steps and ``d2h_wait_lag``, how many were waited for 0, 1 or
        2+ logical layers after the one they started in (2+: a whole layer of compute in
        between; 1: the rest of their own layer).
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return [_dynamic_row(cfg, batch, lengths, steps, fraction, seed, size) for size in (8, 0)]
    finally:
        torch.set_num_threads(before)


def _dynamic_row(cfg, batch, lengths, steps, fraction, seed, cache_size) -> dict:
    torch.manual_seed(seed)
    model = LlamaStyleModel(cfg)
    plain = copy.deepcopy(model)
    seqs = length_schedule(lengths, steps, seed)
    batches = {n: make_batch(cfg, batch, n, seed=seed) for n in set(seqs)}
    budgets = {n: int(fraction * _unswapped_peak(plain, b)) for n, b in batches.items()}
    tick = _CLOCKS["cpu"]
    rows, waits = [], []
    with SmartSwap(model, memory_budget=fraction,
                   config=SmartSwapConfig(plan_cache_size=cache_size)) as smart:
        for n in seqs:
            with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                t0 = tick()
                _train_step(plain, batches[n])
                plain_s = tick() - t0
            stage = smart.stage
            t0 = tick()
            with ResidentSavedBytes(model) as counter:
                _train_step(model, batches[n])
            smart.step()
            rows.append((n, step_kind(stage, smart.last_report), counter.peak, tick() - t0,
                         plain_s))
            waits += smart.last_report.d2h_waits
        cache = smart.plan_cache.stats() if smart.plan_cache is not None else None
    return {**_dynamic_summary(rows, budgets, cache_size, cache),
            "d2h_copies": len(waits), "d2h_wait_lag": _lag_counts(waits)}


def _lag_counts(waits: list[tuple[int, int]]) -> dict[str, int]:
    """Planned copies by how many logical layers after their start they were waited for."""
    lags = [min(at - started, 2) for started, at in waits]
    return {"0": lags.count(0), "1": lags.count(1), ">=2": lags.count(2)}


_LETTER = {"planned": "p", "conservative": "c", "profiling": "P"}


def _dynamic_summary(rows, budgets, cache_size, cache) -> dict:
    kinds = [k for _, k, _, _, _ in rows]
    ratios = [round(peak / budgets[n], 3) for n, _, peak, _, _ in rows]
    planned = [r for r, k in zip(ratios, kinds, strict=True) if k == "planned"]
    return {
        "name": f"varying length, plan_cache_size={cache_size}",
        "steps": len(rows), "lengths": sorted(budgets),
        **{k: kinds.count(k) for k in ("planned", "conservative", "profiling")},
        "over_budget": sum(r > 1 for r in planned),
        "max_peak_over_budget": max(ratios),
        "max_planned_peak_over_budget": max(planned, default=None),
        "step_ms": round(statistics.median(t for *_, t, _ in rows) * 1e3, 3),
        "plain_step_ms": round(statistics.median(p for *_, p in rows) * 1e3, 3),
        "ratio_vs_none": round(_median_ratio([t for *_, t, _ in rows], [p for *_, p in rows]), 4),
        "cache": cache, "peak_over_budget": ratios, "kinds": "".join(_LETTER[k] for k in kinds),
    }


def _unswapped_peak(model: nn.Module, batch) -> int:
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        with ResidentSavedBytes(model) as counter:
            _train_step(model, batch)
    return counter.peak
