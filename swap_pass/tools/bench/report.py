"""Text table, JSON file and memory plot of a :class:`~swap_pass.tools.bench.run.BenchReport`."""

from __future__ import annotations

import dataclasses
import json
import math
import os

from swap_pass.tools.bench.harness import MethodResult
from swap_pass.tools.bench.methods import TOOL_KEYS
from swap_pass.tools.bench.run import BenchReport, load_caveat

__all__ = ["Section", "anchor_line", "format_report", "format_rows", "headline_section",
           "host_section", "tools_section",
           "method_section", "mib", "ms", "plot_memory", "plot_path", "smart_sections", "table",
           "write_json"]


def mib(n: float | None) -> str:
    """Bytes as MiB text ("-" for None)."""
    return "-" if n is None else f"{n / 2**20:.2f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _gbs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _match(r: MethodResult) -> str:
    if r.losses_match is None:
        if not r.reference:
            return "(reference)" if r.key == "no_swap" else "not compared"
        return "-"
    return "exact" if r.losses_match else f"differs {r.max_loss_diff:.1e}"


_HEAD = ["method", "peak MiB", "mem", "step ms", "CPU ms", "time", "cpu", "tok/s", "losses vs ref",
         "D2H GB/s", "H2D GB/s", "host MiB"]


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds text ("-" for None)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _cells(r: MethodResult) -> list[str]:
    return [r.label, mib(r.peak_bytes), _x(r.memory_ratio), ms(r.step_s), ms(r.cpu_s),
            _x(r.time_ratio), _x(r.cpu_ratio), f"{r.tokens_per_s:,.0f}", _match(r),
            _gbs(r.d2h_gbs), _gbs(r.h2d_gbs), mib(r.peak_host_bytes) if r.peak_host_bytes else "-"]


def table(head: list[str], body: list[list[str]]) -> list[str]:
    """Aligned text table: the first column left, the others right, a rule under the head."""
    rows = [head, *body]
    widths = [max(len(line[i]) for line in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_rows(rows: list[MethodResult], head: list[str] | None = None,
                cells=_cells) -> str:
    """Aligned table of the rows that ran, then one line per skipped or failed row."""
    lines = table(head or _HEAD, [cells(r) for r in rows if r.status == "ok"])
    lines += [f"{r.label}: {r.status.upper()}: {r.reason}" for r in rows if r.status != "ok"]
    return "\n".join(lines)


def anchor_line(anchor: dict) -> str:
    """The bandwidth anchor in one line."""
    if anchor.get("status") != "ok":
        return f"bandwidth anchor: skipped ({anchor.get('reason', '')})"
    return (f"bandwidth anchor ({anchor['what']}, {anchor['chunks']} x "
            f"{mib(anchor['chunk_bytes'])} MiB): D2H {anchor['d2h_gbs']:.2f} GB/s, "
            f"H2D {anchor['h2d_gbs']:.2f} GB/s")


# The host table's ratio columns: each swap row over each copying save_on_cpu row (docs/usage.md
# says which to read against which).
_SWAP_HOST_ROWS = ("recompute + swap (eager)", "SmartSwap")
_COPYING_HOST_ROWS = {"torch save_on_cpu (copying both ways)": "/ both ways",
                      "torch save_on_cpu (copying)": "/ copying"}
_HOST_HEAD = ["method", "host us/layer", "IQR us", "cpu", *_COPYING_HOST_ROWS.values()]


def _host_ratio(rows: dict[str, dict], name: str, base: str) -> str:
    denominator = rows.get(base, {}).get("us_per_layer", 0.0)
    if name not in _SWAP_HOST_ROWS or denominator <= 0:
        return "-"
    return _x(rows[name]["us_per_layer"] / denominator)


@dataclasses.dataclass
class Section:
    """One table of the report: its title, column heads and rows of cells, as printed.

    ``swap-pass bench`` prints it with :func:`table`; ``scripts/results_page.py`` writes the
    same cells into ``docs/results.md``, so the page shows what the command printed.
    """

    title: str
    head: list[str]
    body: list[list[str]]

    def lines(self) -> list[str]:
        """The section as text: a blank line, the title, the aligned table."""
        return ["", f"{self.title}:", *table(self.head, self.body)]


def host_section(host: dict) -> Section | None:
    """The host cost per layer (``docs/usage.md``, chapter 7, says how it is taken); None when
    it did not run."""
    if host.get("status") != "ok":
        return None
    rows = host["rows"]
    base = rows["no swap"]["step_cpu_ms"]
    body = [[name, f"{v['us_per_layer']:.1f}", f"{v['iqr_us_per_layer']:.1f}",
             _x(v["step_cpu_ms"] / base), *(_host_ratio(rows, name, b) for b in _COPYING_HOST_ROWS)]
            for name, v in rows.items() if name != "no swap"]
    return Section(f"host cost per layer ({host['layers']} tiny checkpointed layers, 1 thread, "
                   f"median of {host['rounds']} paired rounds; process CPU time added over no "
                   "swap)", _HOST_HEAD, body)


def _host_lines(host: dict) -> list[str]:
    section = host_section(host)
    if section is None:
        return ["", f"host cost per layer: SKIPPED: {host.get('reason', '')}"] if host else []
    return section.lines()


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def _overhead_section(rows: list[dict]) -> Section:
    body = [[r["name"], f"{r['step_ms']:.1f}", _ratio(r["ratio_vs_none"]),
             _ratio(r["ratio_vs_torch_profiler"])] for r in rows]
    clock = rows[0].get("clock", "cpu")
    return Section(f"SmartSwap profiler overhead ({clock} time, median of paired steps)",
                   ["profiler", "step ms", "vs none", "vs torch.profiler"], body)


def _budget_section(rows: list[dict]) -> Section:
    reference = next((r for r in rows if r.get("name") == "no swap"), {})
    steps = [r for r in rows if r.get("name") != "no swap"]
    body = [[str(r["step"]), str(r["seq"]), r["stage"], "yes" if r["fell_back"] else "no",
             mib(r["peak_bytes"]), mib(r["budget_bytes"]), "yes" if r["within_budget"] else "NO",
             mib(r["swapped_bytes"]), f"{r['step_ms']:.1f}"] for r in steps]
    return Section("SmartSwap budget steps (peak saved bytes resident, read from the storages; "
                   f"without swap: {mib(reference.get('peak_bytes'))} MiB)",
                   ["step", "seq", "stage", "fell back", "peak MiB", "budget MiB", "within",
                    "swapped MiB", "step ms"], body)


def _cache_cell(cache: dict | None) -> str:
    if not cache:
        return "-"
    return "/".join(str(cache.get(k, 0)) for k in ("hits", "misses", "evictions", "derived"))


def _dynamic_section(rows: list[dict]) -> Section:
    body = [[r["name"].rpartition("=")[2], str(r["planned"]), str(r["conservative"]),
             str(r["profiling"]), str(r["over_budget"]), f"{r['max_peak_over_budget']:.3f}",
             f"{r['step_ms']:.1f}", f"{r['plain_step_ms']:.1f}", _x(r["ratio_vs_none"]),
             _cache_cell(r.get("cache")), r["kinds"]] for r in rows]
    return Section(f"SmartSwap, varying lengths ({rows[0]['steps']} steps drawn from "
                   f"{rows[0]['lengths']}; CPU time; kinds: p planned, c conservative, "
                   "P profiling)",
                   ["plan cache", "planned", "conservative", "profiling", "over budget",
                    "max peak/budget", "step ms", "plain ms", "cpu", "hit/miss/evict/derived",
                    "kinds"], body)


_SMART_SECTIONS = {"profiler overhead": _overhead_section, "budget": _budget_section,
                   "dynamic": _dynamic_section}


def smart_sections(extra: dict) -> list[Section]:
    """SmartSwap's own rows, one short table per section (every key is in ``--json``)."""
    out = []
    for name, make in _SMART_SECTIONS.items():
        rows = [r["data"] for r in extra.get("rows", [])
                if r.get("section", r.get("label", "").partition(":")[0]) == name]
        if rows:
            out.append(make(rows))
    return out


def _extra_lines(extra: dict) -> list[str]:
    if extra.get("status") != "ok":
        return ["", f"SmartSwap rows: SKIPPED: {extra.get('reason', '')}"]
    return [line for section in smart_sections(extra) for line in section.lines()]


def method_section(rows: list[MethodResult]) -> Section:
    """The upper table: one row per method that ran."""
    return Section("methods", _HEAD, [_cells(r) for r in rows if r.status == "ok"])


_HEADLINE_HEAD = ["method", "peak MiB", "mem", "step ms", "time vs recompute", "D2H GB/s",
                  "D2H / plain", "H2D GB/s", "H2D / plain", "losses vs ref"]


def _of_plain(v: float | None, plain: float | None) -> str:
    return "-" if v is None or not plain else f"{v / plain:.2f}x"


def headline_section(rows: list[MethodResult], anchor: dict) -> Section | None:
    """Each row that ran against full recompute: peak, step time as a ratio to recompute's, and
    achieved copy GB/s as a fraction of a plain copy of the same bytes (the anchor); None without
    a recompute row."""
    if not any(r.key == "recompute" and r.status == "ok" for r in rows):
        return None
    ok = anchor.get("status") == "ok"
    d2h, h2d = (anchor["d2h_gbs"], anchor["h2d_gbs"]) if ok else (None, None)
    body = [[r.label, mib(r.peak_bytes), _x(r.memory_ratio), ms(r.step_s), _x(r.time_vs_recompute),
             _gbs(r.d2h_gbs), _of_plain(r.d2h_gbs, d2h), _gbs(r.h2d_gbs), _of_plain(r.h2d_gbs, h2d),
             _match(r)] for r in rows if r.status == "ok"]
    return Section("against full recompute (time) and a plain copy of the same bytes (GB/s)",
                   _HEADLINE_HEAD, body)


def _over(v: float | None, base: float | None) -> str:
    return "-" if v is None or not base else f"{v / base:.2f}x"


def tools_section(rows: list[MethodResult]) -> Section | None:
    """Fine-tuning tools' offloading against HF checkpointing of the same model: peak, its ratio,
    the device memory swap_pass freed, step and CPU time as ratios of the paired ratios (each row
    and HF checkpointing against the same no-swap steps); None without an HF checkpointing row."""
    base = next((r for r in rows if r.key == "hf_recompute" and r.status == "ok"), None)
    if base is None:
        return None
    body = [[r.label, mib(r.peak_bytes), _over(r.peak_bytes, base.peak_bytes),
             mib(r.peak_device_bytes_released) if r.peak_device_bytes_released else "-",
             _over(r.time_ratio, base.time_ratio), _over(r.cpu_ratio, base.cpu_ratio), _match(r)]
            for r in rows if r.key in TOOL_KEYS and r.status == "ok"]
    return Section("fine-tuning tools' offloading against HF checkpointing (x ckpt: ratio to HF "
                   "checkpointing's)", ["method", "peak MiB", "peak x ckpt", "freed MiB",
                                        "step x ckpt", "CPU x ckpt", "losses vs ref"], body)


def _tools_lines(report: BenchReport) -> list[str]:
    section = tools_section(report.rows)
    return [] if section is None else section.lines()


def _headline_lines(report: BenchReport) -> list[str]:
    section = headline_section(report.rows, report.anchor)
    return [] if section is None else section.lines()


def format_report(report: BenchReport) -> str:
    """The whole report as text: header, table, anchor, notes, SmartSwap's extra rows."""
    m, p = report.meta, report.meta["preset"]
    src = next((r.peak_source for r in report.rows if r.status == "ok"), "")
    loads = m["load_avg_1m"]
    caveat = load_caveat(m, report.rows)
    lines = [
        f"swap-pass bench: preset {p['name']} on {m['device']} ({m['machine']}), "
        f"torch {m['torch']}, {m['date']}",
        f"model: {p['model']['num_layers']} layers, hidden {p['model']['hidden_size']}, "
        f"batch {p['batch']}, seq {p['seq']}, {p['dtype']}; compile rows use "
        f"inner={m['compile_inner']}; "
        f"{p['timed_steps']} timed steps (median), {m.get('threads', '?')} intra-op thread(s); "
        f"load average {loads[0]} -> {loads[-1]}",
        *([caveat] if caveat else []),
        "",
        format_rows(report.rows),
        "",
        f"peak MiB: {src}. mem: ratio to 'no swap'.",
        "step ms / CPU ms: median wall / process CPU time of a step. time / cpu: median of "
        "(step / the no-swap step run right after it), in wall / CPU time; tok/s: tokens per "
        "second of wall time.",
        "losses vs ref: torch.equal at every step against 'no swap' (compile swap: against the "
        "same compile without swap).",
        "D2H/H2D GB/s: achieved by the copies in one profiled step; host MiB: swap_pass's peak "
        "host bytes.",
        anchor_line(report.anchor),
        *_headline_lines(report),
        *_tools_lines(report),
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
        # each row's peak, dashed
        for line, (_, _, y) in zip(axes[0][1].get_lines(), curves, strict=True):
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
