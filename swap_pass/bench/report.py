"""Text table, JSON file and memory plot of a :class:`~swap_pass.bench.run.BenchReport`."""

from __future__ import annotations

import json
import math
import os

from swap_pass.bench.harness import MethodResult
from swap_pass.bench.run import BenchReport, load_caveat

__all__ = ["format_report", "format_rows", "mib", "ms", "plot_memory", "plot_path", "write_json"]


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


_HEAD = ["method", "peak MiB", "mem", "step ms", "CPU ms", "time", "cpu", "tok/s", "losses vs ref",
         "D2H GB/s", "H2D GB/s", "host MiB"]


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds text ("-" for None)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _cells(r: MethodResult) -> list[str]:
    return [r.label, mib(r.peak_bytes), _x(r.memory_ratio), ms(r.step_s), ms(r.cpu_s),
            _x(r.time_ratio), _x(r.cpu_ratio), f"{r.tokens_per_s:,.0f}", _match(r), _gbs(r.d2h_gbs), _gbs(r.h2d_gbs),
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


def _host_lines(host: dict) -> list[str]:
    if host.get("status") != "ok":
        return [f"host us per layer: skipped ({host.get('reason', '')})"] if host else []
    base = host["rows"]["no swap"]["step_cpu_ms"]
    cells = ", ".join(f"{name} {v['us_per_layer']:.1f} (IQR {v['iqr_us_per_layer']:.1f}; step "
                      f"{v['step_cpu_ms'] / base:.2f}x)" for name, v in host["rows"].items()
                      if name != "no swap")
    return [f"host us per layer (process CPU time added per layer per step over no swap; "
            f"{host['layers']} tiny checkpointed layers, 1 thread, collector paused, median of "
            f"{host['rounds']} rounds of adjacent pairs, each step after one of its own; step: "
            f"median step CPU time over no swap's, which the machine's speed moves less): {cells}",
            *_host_ratio_lines(host["rows"])]


# The host row's ratios: each swap row over each copying save_on_cpu row (docs/usage.md says
# which to read against which).
_SWAP_HOST_ROWS = ("recompute + swap (eager)", "SmartSwap")
_COPYING_HOST_ROWS = ("torch save_on_cpu (copying both ways)", "torch save_on_cpu (copying)")


def _host_ratio_lines(rows: dict[str, dict]) -> list[str]:
    lines = []
    for base in _COPYING_HOST_ROWS:
        denominator = rows.get(base, {}).get("us_per_layer", 0.0)
        cells = [f"{name} {rows[name]['us_per_layer'] / denominator:.2f}x"
                 for name in _SWAP_HOST_ROWS if name in rows and denominator > 0]
        if cells:
            lines.append(f"host us per layer over {base}: {', '.join(cells)}")
    return lines


def _extra_lines(extra: dict) -> list[str]:
    if extra.get("status") != "ok":
        return [f"SmartSwap extra rows: SKIPPED: {extra.get('reason', '')}"]
    return [f"SmartSwap {row.get('label')}: {row.get('value')}" for row in extra.get("rows", [])]


def format_report(report: BenchReport) -> str:
    """The whole report as text: header, table, anchor, notes, SmartSwap's extra rows."""
    m, p = report.meta, report.meta["preset"]
    src = next((r.peak_source for r in report.rows if r.status == "ok"), "")
    loads = m["load_avg_1m"]
    caveat = load_caveat(m, report.rows)
    lines = [
        f"swap-pass bench: preset {p['name']} on {m['device']} ({m['machine']}), torch {m['torch']}, {m['date']}",
        f"model: {p['model']['num_layers']} layers, hidden {p['model']['hidden_size']}, batch {p['batch']}, "
        f"seq {p['seq']}, {p['dtype']}; compile rows use inner={m['compile_inner']}; "
        f"{p['timed_steps']} timed steps (median), {m.get('threads', '?')} intra-op thread(s); "
        f"load average {loads[0]} -> {loads[-1]}",
        *([caveat] if caveat else []),
        "",
        format_rows(report.rows),
        "",
        f"peak MiB: {src}. mem: ratio to 'no swap'.",
        "step ms / CPU ms: median wall / process CPU time of a step. time / cpu: median of (step / "
        "the no-swap step run right after it), in wall / CPU time; tok/s: tokens per second of wall time.",
        "losses vs ref: torch.equal at every step against 'no swap' (compile swap: against the same compile without swap).",
        "D2H/H2D GB/s: achieved by the copies in one profiled step; host MiB: swap_pass's peak host bytes.",
        _anchor_line(report.anchor),
        *_host_lines(report.host),
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


def plot_path(json_path: str) -> str:
    """Where the plot of a report written to ``json_path`` goes: beside it, ``.png``."""
    root, _ = os.path.splitext(json_path)
    return root + ".png"


def _curves(report: BenchReport) -> list[tuple[str, list[float], list[float]]]:
    """(label, step fraction 0..1, MiB) per row that ran: steps of any length side by side."""
    out = []
    for r in report.rows:
        if r.status == "ok" and r.curve_ms:
            end = max(r.curve_ms[-1], 1e-9)
            out.append((r.label, [t / end for t in r.curve_ms], [b / 2**20 for b in r.curve_bytes]))
    return out


def _zoom_limit(curves: list) -> float | None:
    """Upper MiB limit of the zoomed panel, or None when every row fits the full one.

    The zoom shows the rows that peak within 2x of the lowest peak (recompute and swap rows
    side by side), when the largest peak is more than 3x the lowest.
    """
    peaks = sorted(max(mib_) for _, _, mib_ in curves)
    if not peaks or peaks[0] <= 0:
        return None
    low = [p for p in peaks if p <= 2 * peaks[0]]
    return 1.15 * low[-1] if peaks[-1] > 3 * peaks[0] else None


def plot_memory(report: BenchReport, path: str) -> None:
    """Draw memory over the profiled step, one line per method that ran, into ``path``.

    The x axis is the fraction of each method's step (0 = start of forward, 1 = end of the
    optimizer step), so rows of different speed line up and load does not stretch them. When
    some rows peak far below others, a second panel zooms in on them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = _curves(report)
    zoom = _zoom_limit(curves)
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(13 if zoom else 8, 5), squeeze=False)
    for ax in axes[0]:
        for label, x, y in curves:
            ax.step(x, y, where="post", label=label, linewidth=1.2)
        ax.set_xlabel("fraction of the step (forward, backward, optimizer)")
        ax.set_ylabel("MiB allocated above the step's start")
        ax.grid(alpha=0.3)
    axes[0][0].set_title("all rows", fontsize=9)
    if zoom:
        for line, (_, _, y) in zip(axes[0][1].get_lines(), curves):  # each row's peak, dashed
            if max(y) <= zoom:
                axes[0][1].axhline(max(y), color=line.get_color(), linestyle="--", linewidth=0.8)
        axes[0][1].set_ylim(0, zoom)
        axes[0][1].set_title(f"zoom: 0 to {zoom:.0f} MiB (dashed: each row's peak)", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.1))
    src = next((r.peak_source for r in report.rows if r.status == "ok"), "")
    fig.suptitle(f"swap-pass bench, preset {report.meta['preset']['name']} on "
                 f"{report.meta['device']}: memory over one step\n{src}", fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
