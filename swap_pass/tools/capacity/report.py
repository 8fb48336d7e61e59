"""Text tables of ``swap-pass capacity`` and ``swap-pass plan --device-memory``, and the JSON
file."""

from __future__ import annotations

import json

from swap_pass.tools.capacity.measured import CapacityReport
from swap_pass.tools.capacity.planned import PlannedRow

__all__ = ["format_capacity", "format_planned", "planner_error", "write_capacity_json"]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return [line(head), "  ".join("-" * w for w in widths), *map(line, rows)]


def planner_error(report: CapacityReport) -> float | None:
    """Largest ``|planned / measured - 1|`` over the rows with both peaks."""
    errs = [abs(r.planned_peak_bytes / r.peak_bytes - 1) for r in report.rows
            if r.planned_peak_bytes and r.peak_bytes and r.max]
    return max(errs, default=None)


def _exact(value: bool | None, at: int | None) -> str:
    return "-" if value is None else f"{'yes' if value else 'NO'} @ {at}"


def format_capacity(report: CapacityReport) -> str:
    """The measured table, the planner's row of peaks, and how the cap was enforced."""
    cap, ref = report.device_memory, next((r for r in report.rows if r.method == "no_swap"), None)
    head = [f"method @ {_mib(cap)}", f"max {report.dim}", "x no swap", "planned max", "peak",
            "planned peak", "need w/o swap",
            "x cap", "host", "step ms", "CPU ms", "losses = no swap", "limited by"]
    rows = []
    for r in report.rows:
        gain = f"{r.max / ref.max:.1f}x" if ref is not None and ref.max and r.max else "-"
        need = f"{r.need_without_swap_bytes / cap:.2f}x" if r.need_without_swap_bytes else "-"
        rows.append([r.label, str(r.max), gain,
                     "-" if r.planned_max is None else str(r.planned_max),
                     _mib(r.peak_bytes), _mib(r.planned_peak_bytes),
                     _mib(r.need_without_swap_bytes), need, _mib(r.host_bytes),
                     "-" if r.step_ms is None else f"{r.step_ms:,.0f}",
                     "-" if r.cpu_ms is None else f"{r.cpu_ms:,.0f}",
                     _exact(r.exact, r.exact_at), r.limited_by])
    err = planner_error(report)
    kind = "VIRTUAL cap, CPU" if report.virtual_cap else "real cap"
    title = (f"swap-pass capacity: largest {report.dim} per method under {_mib(cap)} "
             "of device memory "
             f"({kind}; host limit {_mib(report.host_limit_bytes)})")
    lines = [title,
             *_table(head, rows),
             f"planner: planned peaks within {err:.1%} of the measured peaks"
             if err is not None else "planner: -",
             f"peak: {report.meta['peak_source']}",
             "need w/o swap: the planned no-swap peak at that size "
             "(the planner row shows how close it runs)"]
    return "\n".join(lines)


_PLANNED_LEGEND = (
    "  max: the largest size that fits; peak: the planned device peak at it",
    "  state: parameters, gradients, optimizer state; activations: peak minus state",
    "  host: pinned host memory the swap needs at that size",
    "  x cap: device memory that size needs without swap, as a multiple of the cap",
    "  limited by: what stops a larger size (device or host memory)",
)


def format_planned(rows: list[PlannedRow], cap_bytes: int, host_bytes: int, dim: str,
                   what: str, host_source: str = "--host-memory") -> str:
    """The planned table of ``swap-pass plan --device-memory``, with the host memory it assumed
    and where that came from (``host_source``), a legend of its columns, and a warning per
    host-limited method."""
    head = [f"method @ {_gib(cap_bytes)}", f"max {dim}", "peak", "state", "activations", "host",
            "x cap", "limited by"]
    body = [[r.label, str(r.max), _gib(r.memory.peak_bytes) if r.max else "-",
             _gib(r.memory.state_bytes),
             _gib(r.memory.activation_bytes) if r.max else "-",
             _gib(r.memory.host_bytes) if r.max else "-",
             f"{r.need_without_swap_bytes / cap_bytes:.2f}x" if r.max else "-", r.limited_by]
            for r in rows]
    lines = [f"swap-pass plan --device-memory: {what}",
             f"host memory assumed: {_gib(host_bytes)} ({host_source})",
             *_table(head, body), *_PLANNED_LEGEND]
    for r in rows:
        if r.limited_by == "host":
            lines.append(f"warning: {r.label} is limited by host memory ({_gib(host_bytes)}), "
                         "not by the device")
        if r.max == 0:
            lines.append(f"note: {r.label} does not fit at {dim} 1: "
                         f"model state alone is {_gib(r.memory.state_bytes)}"
                         if r.memory.state_bytes > cap_bytes
                         else f"note: {r.label} does not fit at {dim} 1")
    return "\n".join(lines)


def write_capacity_json(report: CapacityReport, path: str) -> None:
    """Write the report as JSON (``-``: standard output)."""
    text = json.dumps(report.to_json(), indent=2)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")
