"""SmartSwap's benchmark rows for ``swap-pass bench``, and an independent resident-bytes counter.

* :func:`profiler_overhead_rows`: the lightweight profiler's step-time ratio against no
  profiler and against ``torch.profiler`` on the same model (the issue asks for <= 3%).
* :func:`budget_rows`: peak resident saved bytes under SmartSwap against the budget, measured by
  :class:`ResidentSavedBytes`, which reads storage sizes and not SmartSwap's bookkeeping.

Rows are plain dicts so that the CLI can print them as a table or JSON.
"""

from __future__ import annotations

import statistics
import time
import weakref
import torch
from torch import nn

from swap_pass.models import LlamaConfig, LlamaStyleModel, make_batch
from swap_pass.smart.profiler import LightweightProfiler, now, state_storage_ptrs
from swap_pass.smart.smart_swap import SmartSwap

__all__ = ["BENCH_CONFIG", "ResidentSavedBytes", "budget_rows", "profiler_overhead_rows"]

BENCH_CONFIG = LlamaConfig(hidden_size=256, num_layers=4, num_heads=8, intermediate_size=704)


class ResidentSavedBytes:
    """Peak bytes of saved activation storages resident, read from the storages themselves.

    Enter it inside whatever saved-tensor hooks are active (SmartSwap's, or none): it passes
    every pack and unpack through to them, keeps weak references to the storages packed (model
    parameters and buffers excluded) and after each pack and around each unpack sums their
    ``untyped_storage().nbytes()`` (a swapped-out storage reads 0).

    Args:
        model: Whose parameters and buffers are not activations.
    """

    def __init__(self, model: nn.Module) -> None:
        self.state = state_storage_ptrs(model)
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0
        self._hooks = None

    def __enter__(self) -> ResidentSavedBytes:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (_identity, _identity)

        def counted_pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.state:
                self.storages[storage._cdata] = weakref.ref(storage)
            del storage
            handle = pack(t)
            self.sample()
            return handle

        def counted_unpack(handle):
            self.sample()
            t = unpack(handle)
            self.sample()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(counted_pack, counted_unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def resident(self) -> int:
        """Bytes of the packed storages now allocated."""
        live = (ref() for ref in self.storages.values())
        return sum(s.nbytes() for s in live if s is not None)

    def sample(self) -> int:
        """Read :meth:`resident` and keep the peak."""
        value = self.resident()
        self.peak = max(self.peak, value)
        return value


def _identity(x):
    return x


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
    return statistics.median(x / y for x, y in zip(a, b))


def _torch_profiler():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)


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
             "ratio_vs_torch_profiler": round(_median_ratio(ts, tp), 4)} for name, ts in times.items()]


def _null_ctx():
    import contextlib
    return contextlib.nullcontext()


def budget_rows(cfg: LlamaConfig = BENCH_CONFIG, *, batch: int = 2, seq: int = 256,
                fraction: float = 0.25, steps: int = 5, seed: int = 0,
                change_seq: int | None = None, change_steps: int = 2) -> list[dict]:
    """Peak resident saved bytes under SmartSwap against a budget of ``fraction`` x the unswapped peak.

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
