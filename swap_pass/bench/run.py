"""``run_bench``: every method side by side, ratios to no swap, the bandwidth anchor."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from collections.abc import Callable, Iterable

import torch

from swap_pass.bench.harness import MethodResult, build_model, run_method
from swap_pass.bench.measure import anchor_bandwidth
from swap_pass.bench.methods import METHODS, BenchContext, Method, MethodSkipped, require
from swap_pass.bench.presets import BenchPreset
from swap_pass.models import make_batch

__all__ = ["BenchReport", "compare_losses", "describe_machine", "run_bench", "smart_extra_rows"]


@dataclasses.dataclass
class BenchReport:
    """Everything one ``swap-pass bench`` run measured."""

    meta: dict
    rows: list[MethodResult]
    anchor: dict
    extra: dict

    def row(self, key: str) -> MethodResult:
        """The row of method ``key``."""
        return next(r for r in self.rows if r.key == key)

    def to_json(self) -> dict:
        """JSON-ready data: meta, rows, anchor, extra rows."""
        return {"meta": self.meta, "rows": [r.to_json() for r in self.rows],
                "anchor": self.anchor, "extra": self.extra}


def describe_machine(device: torch.device) -> str:
    """One line naming the CPU count and the accelerator, if any."""
    cpu = f"{os.cpu_count()} CPU cores, {platform.machine()}"
    if device.type == "cpu":
        return cpu
    name = torch.get_device_module(device.type).get_device_name(device)
    return f"{name}; {cpu}"


def compare_losses(row: MethodResult, ref: MethodResult) -> None:
    """Set ``row.losses_match`` (``torch.equal`` at every common step) and the largest difference."""
    if row.status != "ok" or ref.status != "ok" or row is ref:
        return
    pairs = list(zip(row.loss_tensors, ref.loss_tensors))
    row.losses_match = all(torch.equal(a, b) for a, b in pairs)
    row.max_loss_diff = max((float((a - b).abs()) for a, b in pairs), default=0.0)


def _ratios(rows: list[MethodResult], base: MethodResult | None) -> None:
    if base is None or base.status != "ok":
        return
    for r in rows:
        if r.status == "ok":
            r.memory_ratio = r.peak_bytes / base.peak_bytes if base.peak_bytes else None
            r.time_ratio = r.step_s / base.step_s
            r.tokens_ratio = r.tokens_per_s / base.tokens_per_s


def _anchor(preset: BenchPreset, device: torch.device, rows: list[MethodResult]) -> dict:
    """A plain copy of the bytes the swap rows moved, one layer input at a time."""
    if not any(r.status == "ok" and r.swapped_out_bytes for r in rows):
        return {"status": "skipped", "reason": "no row moved bytes through swap_pass"}
    chunk, chunks = preset.layer_input_bytes, max(preset.model.num_layers - 1, 1)
    d2h, h2d = anchor_bandwidth(device, chunk, chunks)
    what = "pinned host <-> device copy" if device.type != "cpu" else "CPU memcpy (no device memory)"
    return {"status": "ok", "what": what, "chunk_bytes": chunk, "chunks": chunks,
            "d2h_gbs": d2h, "h2d_gbs": h2d}


def _row_text(row: dict) -> dict:
    text = ", ".join(f"{k}={v}" for k, v in row.items() if k != "name")
    return {"label": str(row.get("name", "")), "value": text, "data": row}


def smart_extra_rows(overhead_steps: int = 60, change_seq: int | None = 384,
                     dynamic_steps: int = 50) -> dict:
    """SmartSwap's own rows from ``swap_pass.smart.bench``: profiler overhead, peak vs budget,
    and a varying-length schedule with and without the plan cache.

    # Note: [SmartSwap bench rows]
    # ``profiler_overhead_rows(steps=...)`` and ``budget_rows()`` return lists of plain dicts
    # (their module documents the keys); this is the single place that calls them. They run
    # SmartSwap's own CPU bench model, whatever the bench's device.

    Args:
        overhead_steps: Timed steps per profiler variant. Default: ``60``.
        change_seq: Sequence length the budget rows switch to after their stable steps (the
            change step's peak against the budget in force); None for no change. Default:
            ``384`` (from 256).
        dynamic_steps: Steps of the varying-length schedule (``dynamic_rows``); 0 for none.
            Default: ``50``.
    """
    try:
        overhead = require("swap_pass.smart.bench", "profiler_overhead_rows")
        budget = require("swap_pass.smart.bench", "budget_rows")
        dynamic = require("swap_pass.smart.bench", "dynamic_rows")
    except MethodSkipped as why:
        return {"status": "skipped", "reason": str(why), "rows": []}
    rows = [{**_row_text(r), "label": f"profiler overhead: {r.get('name', '')}"}
            for r in overhead(steps=overhead_steps)]
    rows += [{**_row_text(r), "label": f"budget: {r.get('name', '')}"}
             for r in budget(change_seq=change_seq)]
    if dynamic_steps:
        rows += [{**_row_text(r), "label": f"dynamic: {r.get('name', '')}"}
                 for r in dynamic(steps=dynamic_steps)]
    return {"status": "ok", "reason": "", "rows": rows}


def _warm_up_kernels(preset: BenchPreset, device: torch.device, seed: int) -> None:
    """One throwaway step of the plain model before any row.

    # Note: [First-call kernels]
    # On torch 2.13 CPU with 2 threads, the first ``torch.tanh`` / ``torch.rsqrt`` of a process
    # over a tensor large enough to be split across threads sometimes differs from every later
    # call (131011 of 262144 elements, up to 5e-5; never with one thread). A row that happened to
    # run first would then "differ" from the others at step 0. Every row runs after this step.
    """
    model = build_model(preset, False, device, seed)
    input_ids, labels = make_batch(preset.model, preset.batch, preset.seq, seed=seed, device=device)
    model(input_ids, labels).backward()


def _load() -> float | None:
    """The 1-minute load average (other work on the machine skews the step times)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _select(keys: Iterable[str] | None) -> list[Method]:
    if keys is None:
        return list(METHODS)
    keys = set(keys) | {"no_swap"}  # the reference of every ratio
    unknown = keys - {m.key for m in METHODS}
    if unknown:
        raise ValueError(f"swap_pass.bench: methods {sorted(unknown)} are unknown. "
                         f"They must be among {[m.key for m in METHODS]}.")
    return [m for m in METHODS if m.key in keys]


def run_bench(preset: BenchPreset, ctx: BenchContext, *, methods: Iterable[str] | None = None,
              seed: int = 0, smart_budget_fraction: float = 0.25, command: str = "",
              progress: Callable[[str], None] | None = None,
              on_step: Callable[[], None] | None = None, smart_rows: bool = True) -> BenchReport:
    """Run the selected methods (default: all) and return the report.

    Args:
        progress: Called with each method's label before it runs. Default: ``None``.
        on_step: Called after every training step of every method. Default: ``None``.
        smart_rows: Also run SmartSwap's own rows (:func:`smart_extra_rows`). Default: ``True``.
    """
    rows: list[MethodResult] = []
    load_before = _load()
    _warm_up_kernels(preset, ctx.device, seed)
    for method in _select(methods):
        if progress is not None:
            progress(method.label)
        rows.append(run_method(method, preset, ctx, seed, on_step=on_step))
        if method.key == "no_swap" and rows[-1].status == "ok":
            ctx.smart_budget_bytes = int(rows[-1].peak_bytes * smart_budget_fraction)
    by_key = {r.key: r for r in rows}
    for r in rows:
        if r.reference in by_key:
            compare_losses(r, by_key[r.reference])
    _ratios(rows, by_key.get("no_swap"))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe_machine(ctx.device), "device": str(ctx.device),
            "torch": torch.__version__, "preset": dataclasses.asdict(preset),
            "compile_inner": ctx.compile_inner, "smart_budget_bytes": ctx.smart_budget_bytes,
            "seed": seed, "command": command, "load_avg_1m": [load_before, _load()]}
    extra = smart_extra_rows() if smart_rows else {"status": "skipped", "reason": "--no-smart-rows", "rows": []}
    return BenchReport(meta, rows, _anchor(preset, ctx.device, rows), extra)
