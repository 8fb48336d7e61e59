"""``run_bench``: every method side by side, ratios to no swap, the bandwidth anchor."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import warnings
from collections.abc import Callable, Iterable

import torch

from swap_pass.tools.bench.harness import MethodResult, pace_setter, run_method
from swap_pass.tools.bench.measure import anchor_bandwidth, intra_op_threads, quiet_profiler
from swap_pass.tools.bench.methods import METHODS, BenchContext, Method, MethodSkipped, require
from swap_pass.tools.bench.presets import BenchPreset

__all__ = ["BenchReport", "compare_losses", "describe_machine", "host_cost_rows", "load_caveat",
           "run_bench", "select_methods", "smart_extra_rows", "source_build", "spread"]


@dataclasses.dataclass
class BenchReport:
    """Everything one ``swap-pass bench`` run measured."""

    meta: dict
    rows: list[MethodResult]
    anchor: dict
    extra: dict
    host: dict = dataclasses.field(default_factory=dict)

    def row(self, key: str) -> MethodResult:
        """The row of method ``key``."""
        return next(r for r in self.rows if r.key == key)

    def to_json(self) -> dict:
        """JSON-ready data: meta, rows, anchor, extra rows, host cost per layer."""
        return {"meta": self.meta, "rows": [r.to_json() for r in self.rows],
                "anchor": self.anchor, "extra": self.extra, "host": self.host}


def describe_machine(device: torch.device) -> str:
    """One line naming the CPU count and the accelerator, if any."""
    cpu = f"{os.cpu_count()} CPU cores, {platform.machine()}"
    if device.type == "cpu":
        return cpu
    get_name = getattr(torch.get_device_module(device.type), "get_device_name", None)
    name = get_name(device) if get_name is not None else device.type  # not every backend names it
    return f"{name}; {cpu}"


def source_build() -> str:
    """``git describe --always --dirty`` of the checkout swap_pass runs from ("" outside one)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def compare_losses(row: MethodResult, ref: MethodResult) -> None:
    """Set ``row.losses_match`` (``torch.equal`` at every common step) and the largest
    difference."""
    if row.status != "ok" or ref.status != "ok" or row is ref:
        return
    pairs = list(zip(row.loss_tensors, ref.loss_tensors, strict=False))  # the common steps
    row.losses_match = all(torch.equal(a, b) for a, b in pairs)
    row.max_loss_diff = max((float((a - b).abs()) for a, b in pairs), default=0.0)


def _ratios(rows: list[MethodResult], base: MethodResult | None) -> None:
    """Memory against the no-swap row; time against the paired no-swap steps
    (Note: [Paired timing])."""
    for r in rows:
        if r.status != "ok":
            continue
        if base is not None and base.status == "ok" and base.peak_bytes:
            r.memory_ratio = r.peak_bytes / base.peak_bytes
        if r.paired_cpu_ratios:
            r.cpu_ratio = statistics.median(r.paired_cpu_ratios)
        if r.paired_ratios:
            r.time_ratio = statistics.median(r.paired_ratios)
        elif base is not None and base.status == "ok":
            r.time_ratio = r.step_s / base.step_s
        r.tokens_ratio = 1 / r.time_ratio if r.time_ratio else None
    _against_recompute(rows)


def _against_recompute(rows: list[MethodResult]) -> None:
    """Each row's time ratio over full recompute's (both against the same no-swap steps)."""
    rec = next((r for r in rows if r.key == "recompute" and r.status == "ok"), None)
    if rec is None or not rec.time_ratio:
        return
    for r in rows:
        if r.status == "ok" and r.time_ratio:
            r.time_vs_recompute = r.time_ratio / rec.time_ratio


def spread(row: MethodResult) -> float | None:
    """Run-to-run spread of a row's paired time ratios: interquartile range / median."""
    if len(row.paired_ratios) < 2:
        return None
    q = statistics.quantiles(row.paired_ratios, n=4, method="inclusive")
    return (q[2] - q[0]) / q[1]


def load_caveat(meta: dict, rows: list[MethodResult], max_spread: float = 0.1) -> str:
    """One line when step times are not to be trusted: busy cores or a wide paired spread."""
    cores = os.cpu_count() or 1
    loads = [x for x in meta.get("load_avg_1m", []) if x is not None]
    spreads = [s for s in map(spread, rows) if s is not None]
    busy = max(loads, default=0.0) >= cores
    wide = max(spreads, default=0.0) > max_spread
    if not (busy or wide):
        return ""
    return (f"caveat: step times are rough here (load average up to "
            f"{max(loads, default=0.0):.1f} on {cores} cores; run-to-run spread of paired step "
            "times up to "
            f"{max(spreads, default=0.0):.0%}); CPU ms move less, memory and losses not at all")


def _anchor(preset: BenchPreset, device: torch.device, rows: list[MethodResult]) -> dict:
    """A plain copy of the bytes the swap rows moved, one layer input at a time."""
    if not any(r.status == "ok" and r.swapped_out_bytes for r in rows):
        return {"status": "skipped", "reason": "no row moved bytes through swap_pass"}
    chunk, chunks = preset.layer_input_bytes, max(preset.model.num_layers - 1, 1)
    d2h, h2d = anchor_bandwidth(device, chunk, chunks)
    what = ("pinned host <-> device copy" if device.type != "cpu"
            else "CPU memcpy (no device memory)")
    return {"status": "ok", "what": what, "chunk_bytes": chunk, "chunks": chunks,
            "d2h_gbs": d2h, "h2d_gbs": h2d}


def _extra_row(section: str, row: dict) -> dict:
    """One of SmartSwap's rows: its section, a label, and every key it returned (``data``)."""
    return {"section": section, "label": f"{section}: {row.get('name', '')}", "data": row}


def smart_extra_rows(overhead_steps: int = 8, change_seq: int | None = 384,
                     dynamic_steps: int = 5) -> dict:
    """SmartSwap's own rows from ``swap_pass.tools.smart_bench``: profiler overhead, peak vs budget,
    and a varying-length schedule with and without the plan cache.

    # Note: [SmartSwap bench rows]
    # ``profiler_overhead_rows(steps=...)`` and ``budget_rows()`` return lists of plain dicts
    # (their module documents the keys); this is the single place that calls them. They run
    # SmartSwap's own CPU bench model, whatever the bench's device.

    Args:
        overhead_steps: Timed steps per profiler variant. Default: ``8`` (with fewer, the paired
            medians wander between runs by about as much as the overhead they measure).
        change_seq: Sequence length the budget rows switch to after their stable steps (the
            change step's peak against the budget in force); None for no change. Default:
            ``384`` (from 256).
        dynamic_steps: Steps of the varying-length schedule (``dynamic_rows``); 0 for none.
            Default: ``5`` (with the plan cache, a length seen before runs a plan; without it,
            profiling keeps coming back).
    """
    try:
        overhead = require("swap_pass.tools.smart_bench", "profiler_overhead_rows")
        budget = require("swap_pass.tools.smart_bench", "budget_rows")
        dynamic = require("swap_pass.tools.smart_bench", "dynamic_rows")
    except MethodSkipped as why:
        return {"status": "skipped", "reason": str(why), "rows": []}
    rows = [_extra_row("profiler overhead", r) for r in overhead(steps=overhead_steps)]
    rows += [_extra_row("budget", r) for r in budget(change_seq=change_seq)]
    if dynamic_steps:
        rows += [_extra_row("dynamic", r) for r in dynamic(steps=dynamic_steps)]
    return {"status": "ok", "reason": "", "rows": rows}


def _warm_up_kernels(pace) -> None:
    """One step of the pace setter before any row.

    # Note: [First-call kernels]
    # On torch 2.13 CPU with 2 threads, the first ``torch.tanh`` / ``torch.rsqrt`` of a process
    # over a tensor large enough to be split across threads sometimes differs from every later
    # call (131011 of 262144 elements, up to 5e-5; never with one thread). A row that happened to
    # run first would then "differ" from the others at step 0. Every row runs after this step.
    """
    pace.step()


def load_average() -> float | None:
    """The 1-minute load average (other work on the machine skews the step times)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def select_methods(keys: Iterable[str] | None) -> list[Method]:
    """The methods named by ``keys`` in :data:`METHODS` order, with no swap and each one's loss
    reference (and that one's) among them (None: all).

    Raises:
        ValueError: naming the unknown keys and the known ones.
    """
    if keys is None:
        return list(METHODS)
    keys = set(keys) | {"no_swap"}  # the reference of every ratio
    unknown = keys - {m.key for m in METHODS}
    if unknown:
        raise ValueError(f"swap_pass.tools.bench: methods {sorted(unknown)} are unknown. "
                         f"They must be among {[m.key for m in METHODS]}.")
    references = {m.key: m.reference for m in METHODS}
    for key in list(keys):  # each row's loss reference, and its reference's, run too
        while references.get(key):
            key = references[key]
            keys.add(key)
    return [m for m in METHODS if m.key in keys]


def run_bench(preset: BenchPreset, ctx: BenchContext, *, methods: Iterable[str] | None = None,
              seed: int = 0, smart_budget_fraction: float = 0.25, command: str = "",
              progress: Callable[[str], None] | None = None,
              on_step: Callable[[], None] | None = None, smart_rows: bool = True,
              host_rows: bool = True, threads: int | None = 1) -> BenchReport:
    """Run the selected methods (default: all) and return the report.

    Args:
        progress: Called with each method's label before it runs, and with the name of each
            later phase (SmartSwap's own rows, host CPU time) before it starts. Default: ``None``.
        on_step: Called after every training step of every method. Default: ``None``.
        smart_rows: Also run SmartSwap's own rows (:func:`smart_extra_rows`). Default: ``True``.
        host_rows: Also measure host CPU time per layer (:func:`host_cost_rows`). Default: ``True``.
        threads: Intra-op threads while measuring (None: as set). Default: ``1``.
    """
    with intra_op_threads(threads):
        report = _run(preset, ctx, select_methods(methods), seed, smart_budget_fraction, progress,
                      on_step)
        report.meta.update(command=command, threads=torch.get_num_threads())
        if smart_rows and progress is not None:
            progress("SmartSwap's own rows (profiler overhead, budget steps, varying lengths)")
        with quiet_profiler():  # SmartSwap's rows run torch.profiler too
            report.extra = smart_extra_rows() if smart_rows else \
                {"status": "skipped", "reason": "--no-smart-rows", "rows": []}
    if host_rows and progress is not None:
        progress("host CPU time per layer (16 tiny layers, 60 paired rounds)")
    report.host = (host_cost_rows() if host_rows
                   else {"status": "skipped", "reason": "--no-host-rows"})
    report.meta["load_avg_1m"].append(load_average())
    return report


def host_cost_rows(layers: int = 16, rounds: int = 60, warmup: int = 3) -> dict:
    """Host CPU time per layer per step of each way in (:mod:`swap_pass.tools.bench.host_cost`).

    Args:
        layers: Tiny checkpointed layers of the model. Default: ``16``.
        rounds: Rounds of paired steps the medians are taken over. Default: ``60``.
        warmup: Steps of each method before the rounds. Default: ``3``.
    """
    from swap_pass.tools.bench.host_cost import host_us_per_layer

    with warnings.catch_warnings():
        # SmartSwap says once that its budget cannot be met on layers this small; this row
        # measures host time, not memory.
        warnings.filterwarnings("ignore", message=r"swap_pass\.SmartSwap: memory_budget",
                                category=RuntimeWarning)
        rows = host_us_per_layer(layers=layers, rounds=rounds, warmup=warmup)
    return {"status": "ok", "layers": layers, "rounds": rounds, "rows": rows}


def _run(preset: BenchPreset, ctx: BenchContext, methods: list[Method], seed: int,
         smart_budget_fraction: float, progress: Callable[[str], None] | None,
         on_step: Callable[[], None] | None) -> BenchReport:
    rows: list[MethodResult] = []
    load_before, build = load_average(), source_build()  # as the measuring starts
    pace = pace_setter(preset, ctx.device, seed)
    _warm_up_kernels(pace)
    for method in methods:
        if progress is not None:
            progress(method.label)
        rows.append(run_method(method, preset, ctx, seed, on_step=on_step, pace=pace))
        if method.key == "no_swap" and rows[-1].status == "ok":
            ctx.smart_budget_bytes = int(rows[-1].peak_bytes * smart_budget_fraction)
    by_key = {r.key: r for r in rows}
    for r in rows:
        if r.reference in by_key:
            compare_losses(r, by_key[r.reference])
    _ratios(rows, by_key.get("no_swap"))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe_machine(ctx.device), "device": str(ctx.device),
            "torch": torch.__version__, "build": build,
            "preset": dataclasses.asdict(preset),
            "compile_inner": ctx.compile_inner, "smart_budget_bytes": ctx.smart_budget_bytes,
            "seed": seed, "load_avg_1m": [load_before, load_average()]}
    return BenchReport(meta, rows, _anchor(preset, ctx.device, rows), {})
