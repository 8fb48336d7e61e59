"""``swap-pass capacity``: the largest batch, sequence or hidden size each method trains under a
cap.

Each probe of the search (:func:`swap_pass.tools.capacity.search.largest_fitting`) is the bench's
own measurement of one method at one size (:func:`swap_pass.tools.bench.harness.run_method`: a fresh
model, warm-up, one timed step, one profiled step). A size fits when the step ran, its peak is
within the device-memory cap (:mod:`swap_pass.tools.capacity.limits`) and its host bytes within the
host limit. The first probe is the planner's answer (:mod:`swap_pass.tools.memory_model`), so a good
plan costs two probes per method.

SmartSwap's budget (kept saved-activation bytes) is derived from the cap at each size: the cap
minus the model state and minus the transient bytes of the step (gradients in flight), both
from the planner.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import warnings
from collections.abc import Callable

import torch

from swap_pass import HostMemoryError, SwapConfig
from swap_pass.tools.bench.harness import MethodResult, run_method
from swap_pass.tools.bench.measure import intra_op_threads
from swap_pass.tools.bench.methods import BenchContext, Method
from swap_pass.tools.bench.presets import BenchPreset
from swap_pass.tools.bench.run import (
    compare_losses,
    describe_machine,
    load_average,
    select_methods,
    source_build,
)
from swap_pass.tools.capacity.limits import available_host_bytes, device_memory_cap
from swap_pass.tools.capacity.planned import (
    METHOD_LABELS,
    dim_quantum,
    plan_capacity,
    planned_memory,
    sized_preset,
    smart_budget,
)
from swap_pass.tools.capacity.search import largest_fitting
from swap_pass.tools.memory_model import ModelShape, method_memory, state_bytes

__all__ = ["CapacityReport", "CapacityRow", "Probe", "run_capacity"]


@dataclasses.dataclass
class Probe:
    """One size tried: whether it fit, and what was measured (or why nothing was)."""

    size: int
    fits: bool
    peak_bytes: int | None = None
    host_bytes: int = 0
    limited_by: str = ""  # "device" or "host" when it did not fit
    reason: str = ""
    smart_budget_bytes: int | None = None
    result: MethodResult | None = dataclasses.field(default=None, repr=False)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("result")
        return out


@dataclasses.dataclass
class CapacityRow:
    """One method's answer (the JSON row; see docs/capacity.md)."""

    method: str
    label: str
    max: int
    peak_bytes: int | None
    need_without_swap_bytes: int | None
    exact: bool | None
    step_ms: float | None
    cpu_ms: float | None
    exact_at: int | None = None
    planned_max: int | None = None
    planned_peak_bytes: int | None = None
    host_bytes: int = 0
    limited_by: str = ""
    smart_budget_bytes: int | None = None
    probes: list[Probe] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["probes"] = [p.to_json() for p in self.probes]
        return out


@dataclasses.dataclass
class CapacityReport:
    """Everything one ``swap-pass capacity`` run found."""

    device_memory: int
    dim: str
    virtual_cap: bool
    host_limit_bytes: int
    rows: list[CapacityRow]
    meta: dict

    def row(self, method: str) -> CapacityRow:
        """The row of ``method``."""
        return next(r for r in self.rows if r.method == method)

    def to_json(self) -> dict:
        return {"device_memory": self.device_memory, "dim": self.dim,
                "virtual_cap": self.virtual_cap, "host_limit_bytes": self.host_limit_bytes,
                "rows": [r.to_json() for r in self.rows], "meta": self.meta}


class _MethodSkipped(Exception):
    """The method cannot run in this build (its row says why); raised out of the search."""


@dataclasses.dataclass
class _Search:
    """Probes of one capacity run, kept by (method, size)."""

    preset: BenchPreset
    dim: str
    device: torch.device
    cap: int
    host_limit: int
    virtual: bool
    seed: int = 0
    compile_inner: str = "aot_eager"
    progress: Callable[[str], None] | None = None
    probes: dict = dataclasses.field(default_factory=dict)

    def shape(self, units: int) -> ModelShape:
        return ModelShape.from_preset(sized_preset(self.preset, self.dim, units))

    def probe(self, method: Method, units: int) -> Probe:
        """``method`` at ``units`` (cached): planned host bytes first, then one measured run."""
        key = (method.key, units)
        if key not in self.probes:
            self.probes[key] = probe = self._run(method, units)
            if self.progress is not None:
                why = f"{probe.limited_by}: {probe.reason}" if probe.reason else probe.limited_by
                verdict = "fits" if probe.fits else f"does not fit ({why})"
                peak = ("" if probe.peak_bytes is None
                        else f": peak {probe.peak_bytes / 2**20:,.1f} MiB")
                self.progress(f"{method.key} {self.dim} {probe.size}{peak}, {verdict}")
        return self.probes[key]

    def _run(self, method: Method, units: int) -> Probe:
        size, shape = units * dim_quantum(self.preset, self.dim), self.shape(units)
        budget = smart_budget(shape, self.cap) if method.key == "smartswap" else None
        if (method.key in METHOD_LABELS
                and method_memory(shape, method.key, budget).host_bytes > self.host_limit):
            return Probe(size, False, limited_by="host",
                         reason="planned host bytes pass the host limit; not run")
        if budget is not None and budget <= 0:
            return Probe(size, False, limited_by="device",
                         reason="no SmartSwap budget left under the cap; not run")
        return self._measure(method, size, units, budget)

    def _measure(self, method: Method, size: int, units: int, budget: int | None) -> Probe:
        errors: list[BaseException] = []
        _release(self.device)
        ctx = BenchContext(self.device, self.compile_inner, smart_budget_bytes=budget,
                           swap_config=SwapConfig(max_host_bytes=self.host_limit))
        preset = sized_preset(self.preset, self.dim, units).resized(timed_steps=1)
        # Past the largest size SmartSwap says its budget is unreachable.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"swap_pass\.SmartSwap: memory_budget",
                                    category=RuntimeWarning)
            try:
                result = run_method(method, preset, ctx, self.seed, on_error=errors.append)
            except torch.OutOfMemoryError as err:
                # The model itself did not fit (built before the step).
                return _failed(size, err, budget)
        if result.status == "skipped":
            raise _MethodSkipped(result.reason)
        if errors:
            return _failed(size, errors[0], budget)
        peak = self._peak(result, units)
        fits = peak <= self.cap and result.peak_host_bytes <= self.host_limit
        limited = "" if fits else "device" if peak > self.cap else "host"
        return Probe(size, fits, peak, result.peak_host_bytes, limited, "", budget, result)

    def _peak(self, result: MethodResult, units: int) -> int:
        """Real cap: the allocator's peak of the profiled step. Virtual: model state + the step's
        peak."""
        if self.virtual:
            return state_bytes(self.shape(units)) + result.peak_bytes
        return torch.accelerator.max_memory_allocated(self.device)


def _failed(size: int, err: BaseException, budget: int | None) -> Probe:
    """A run that raised: out of device memory or host memory is 'does not fit'; anything else is
    a bug."""
    if isinstance(err, torch.OutOfMemoryError):
        return Probe(size, False, limited_by="device", reason=f"out of memory: {str(err)[:120]}",
                     smart_budget_bytes=budget)
    if isinstance(err, HostMemoryError):
        return Probe(size, False, limited_by="host", reason=f"host memory: {str(err)[:120]}",
                     smart_budget_bytes=budget)
    raise err


def _release(device: torch.device) -> None:
    """Return the previous probe's memory before the next one starts."""
    gc.collect()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
        torch.accelerator.empty_cache()


def _limited_by(search: _Search, method: Method, units: int, limit: int) -> str:
    if units == limit:
        return "search range"
    beyond = search.probes.get((method.key, units + 1))
    return beyond.limited_by if beyond is not None else "device"


def _row(search: _Search, method: Method, start: int, limit: int) -> CapacityRow:
    """Search ``method``'s largest size and fill its row from the probe at that size."""
    label = METHOD_LABELS.get(method.key, method.label)
    try:
        units = largest_fitting(lambda u: search.probe(method, u).fits, start, limit)
    except _MethodSkipped as why:
        return CapacityRow(method.key, label, 0, None, None, None, None, None,
                           limited_by=f"skipped: {why}")
    planned_max = (start * dim_quantum(search.preset, search.dim)
                   if method.key in METHOD_LABELS else None)
    probes = sorted((p for (k, _), p in search.probes.items() if k == method.key),
                    key=lambda p: p.size)
    if units == 0:
        first = search.probes[(method.key, 1)]
        return CapacityRow(method.key, label, 0, first.peak_bytes, None, None, None, None,
                           planned_max=planned_max, limited_by=first.limited_by, probes=probes)
    best, shape = search.probe(method, units), search.shape(units)
    r = best.result
    planned = (planned_memory(shape, method.key, search.cap).peak_bytes
               if method.key in METHOD_LABELS else None)
    return CapacityRow(method.key, label, best.size, best.peak_bytes,
                       method_memory(shape, "no_swap").peak_bytes,
                       None, r.step_s * 1e3, r.cpu_s * 1e3, planned_max=planned_max,
                       planned_peak_bytes=planned, host_bytes=best.host_bytes,
                       limited_by=_limited_by(search, method, units, limit),
                       smart_budget_bytes=best.smart_budget_bytes, probes=probes)


def _exactness(search: _Search, rows: list[CapacityRow], methods: list[Method]) -> None:
    """Losses of each method against its reference, at the largest size both fit
    (``torch.equal``)."""
    by_key = {r.method: r for r in rows}
    quantum = dim_quantum(search.preset, search.dim)
    for row, method in zip(rows, methods, strict=True):
        ref = by_key.get(method.reference)
        if ref is None or row.max == 0 or ref.max == 0:
            continue
        units = min(row.max, ref.max) // quantum
        mine, theirs = (search.probe(method, units),
                        search.probe(_method(methods, ref.method), units))
        if mine.result is None or theirs.result is None:
            continue
        compare_losses(mine.result, theirs.result)
        row.exact, row.exact_at = mine.result.losses_match, units * quantum


def _method(methods: list[Method], key: str) -> Method:
    return next(m for m in methods if m.key == key)


def run_capacity(preset: BenchPreset, device: torch.device, cap_bytes: int, *,
                 dim: str = "batch", methods: list[str] | None = None,
                 host_limit_bytes: int | None = None, seed: int = 0, threads: int | None = 1,
                 limit: int = 1 << 16, compile_inner: str = "aot_eager", command: str = "",
                 progress: Callable[[str], None] | None = None) -> CapacityReport:
    """Largest size per method under ``cap_bytes`` of device memory (see the module's docstring).

    Args:
        dim: ``"batch"``, ``"seq"`` or ``"hidden"``. Default: ``"batch"``.
        methods: Method keys of :data:`swap_pass.tools.bench.methods.METHODS`; no swap is always
            among them (the reference). Default: no swap, full recompute, recompute + swap,
            SmartSwap.
        host_limit_bytes: Host memory the swapping methods may hold; None for what the machine
            has available now. Default: ``None``.
        threads: Intra-op CPU threads while measuring (None: as set). Default: ``1``.
        limit: Largest size searched, in units of ``dim`` (hidden: twice the heads).
            Default: ``2**16``.
        progress: Called with a line per method and per probe. Default: ``None``.
    """
    chosen = select_methods(methods or list(METHOD_LABELS))
    load_before, build = load_average(), source_build()  # as the measuring starts
    host = available_host_bytes() if host_limit_bytes is None else host_limit_bytes
    keys = tuple(m.key for m in chosen if m.key in METHOD_LABELS)
    planned = {p.method: p.max // dim_quantum(preset, dim)
               for p in plan_capacity(preset, dim, cap_bytes, host, methods=keys, limit=limit)}
    with intra_op_threads(threads), device_memory_cap(device, cap_bytes) as virtual:
        search = _Search(preset, dim, device, cap_bytes, host, virtual, seed, compile_inner,
                         progress)
        rows = []
        for m in chosen:
            start = planned.get(m.key, planned["no_swap"])
            if progress is not None:
                progress(f"{m.label}: searching {dim} from "
                         f"{start * dim_quantum(preset, dim)} (planned)")
            rows.append(_row(search, m, start, limit))
        _exactness(search, rows, chosen)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe_machine(device), "device": str(device), "torch": torch.__version__,
            "preset": dataclasses.asdict(preset), "command": command, "seed": seed,
            "threads": threads, "peak_source": _peak_source(virtual), "build": build,
            "load_avg_1m": [load_before, load_average()]}
    return CapacityReport(cap_bytes, dim, virtual, host, rows, meta)


def _peak_source(virtual: bool) -> str:
    if virtual:
        return ("virtual cap: model state (parameters, gradients, optimizer state, buffers, batch; "
                "counted from the model) + the profiled step's peak above its start "
                "(torch.profiler memory events)")
    return ("real cap (set_per_process_memory_fraction): torch.accelerator.max_memory_allocated "
            "of the profiled step")
