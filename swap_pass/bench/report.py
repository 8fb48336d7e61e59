"""Text table, JSON file and memory plot of a :class:`~swap_pass.bench.run.BenchReport`."""

from __future__ import annotations

import json
import math
import os

from swap_pass.bench.harness import MethodResult
from swap_pass.bench.run import BenchReport

__all__ = ["format_report", "format_rows", "mib", "plot_memory", "write_json"]


def mib(n: float | None) -> str:
    """Bytes as MiB text ("-" for None)."""
    return "-" if n is None else f"{n / 2**20:.2f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _gbs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _match(r: MethodResult) -> str:
    if r.losses_match is None:
        return "(reference)" if not r.reference else "-"
    return "exact" if r.losses_match else f"differs {r.max_loss_diff:.1e}"


_HEAD = ["method", "peak MiB", "mem", "step ms", "time", "tok/s", "losses vs ref",
         "D2H GB/s", "H2D GB/s", "host MiB"]


def _cells(r: MethodResult) -> list[str]:
    return [r.label, mib(r.peak_bytes), _x(r.memory_ratio), f"{r.step_s * 1e3:.1f}", _x(r.time_ratio),
            f"{r.tokens_per_s:,.0f}", _match(r), _gbs(r.d2h_gbs), _gbs(r.h2d_gbs),
            mib(r.peak_host_bytes) if r.peak_host_bytes else "-"]


def format_rows(rows: list[MethodResult], head: list[str] | None = None,
                cells=_cells) -> str:
    """Aligned table of the rows that ran, then one line per skipped or failed row."""
    head = head or _HEAD
    table = [head] + [cells(r) for r in rows if r.status == "ok"]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{r.label}: {r.status.upper()}: {r.reason}" for r in rows if r.status != "ok"]
    return "\n".join(lines)


def _anchor_line(anchor: dict) -> str:
    if anchor.get("status") != "ok":
        return f"bandwidth anchor: skipped ({anchor.get('reason', '')})"
    return (f"bandwidth anchor ({anchor['what']}, {anchor['chunks']} x {mib(anchor['chunk_bytes'])} MiB): "
            f"D2H {anchor['d2h_gbs']:.2f} GB/s, H2D {anchor['h2d_gbs']:.2f} GB/s")


def _extra_lines(extra: dict) -> list[str]:
    if extra.get("status") != "ok":
        return [f"SmartSwap extra rows: SKIPPED: {extra.get('reason', '')}"]
    return [f"SmartSwap {row.get('label')}: {row.get('value')}" for row in extra.get("rows", [])]


def format_report(report: BenchReport) -> str:
    """The whole report as text: header, table, anchor, notes, SmartSwap's extra rows."""
    m, p = report.meta, report.meta["preset"]
    src = next((r.peak_source for r in report.rows if r.status == "ok"), "")
    lines = [
        f"swap-pass bench: preset {p['name']} on {m['device']} ({m['machine']}), torch {m['torch']}, {m['date']}",
        f"model: {p['model']['num_layers']} layers, hidden {p['model']['hidden_size']}, batch {p['batch']}, "
        f"seq {p['seq']}, {p['dtype']}; compile rows use inner={m['compile_inner']}; "
        f"{p['timed_steps']} timed steps (median); load average {m['load_avg_1m'][0]} -> {m['load_avg_1m'][1]}",
        "",
        format_rows(report.rows),
        "",
        f"peak MiB: {src}. mem/time/tok/s: ratios to 'no swap'.",
        "losses vs ref: torch.equal at every step against 'no swap' (compile swap: against the same compile without swap).",
        "D2H/H2D GB/s: achieved by the copies in one profiled step; host MiB: swap_pass's peak host bytes.",
        _anchor_line(report.anchor),
        *_extra_lines(report.extra),
    ]
    return "\n".join(lines)


def _clean(obj):
    """NaN and infinities become None so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(report: BenchReport, path: str) -> None:
    """Write the report as strict JSON to ``path`` (folders made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(report.to_json()), f, indent=2, allow_nan=False)


def plot_memory(report: BenchReport, path: str) -> None:
    """Draw memory over the profiled step, one line per method that ran, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in report.rows:
        if r.status == "ok" and r.curve_ms:
            ax.step(r.curve_ms, [b / 2**20 for b in r.curve_bytes], where="post", label=r.label)
    src = next((r.peak_source for r in report.rows if r.status == "ok"), "")
    ax.set_xlabel("time since the step began (ms)")
    ax.set_ylabel("MiB allocated above the step's start")
    ax.set_title(f"swap-pass bench, preset {report.meta['preset']['name']} on {report.meta['device']}\n{src}",
                 fontsize=9)
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
