"""Where the host time of a swap goes: one tool, four ways of looking, for maintainers.

``swap-pass bench`` prints the figure users read: the host CPU time each way of keeping
activations adds per layer (``swap_pass.tools.bench.host_cost``: tiny checkpointed layers, compute
negligible). This tool takes the same model and the same methods (``HOST_METHODS``, the bench's
own builders) apart, one mode at a time:

* ``time``: the bench's measure itself (paired rounds, collector paused), with the layers,
  rounds and methods chosen here; its table is the bench's.
* ``stages``: each stage of one layer's swap timed inside real steps (``perf_counter_ns``
  around it, in the state the layer's own compute leaves the caches in): the bench's bare
  reference (``MinimalSwapForward``, its stages timed one by one) beside one ``SwapTensors``
  group per layer driven through its public transitions, then what each of them and
  ``enable_swap_layer_input`` add per layer (the least step CPU time of the steps).
* ``calls``: Python bytecodes and calls a method adds per layer over ``no swap``, per function,
  traced with ``sys.settrace``: a count that does not move from run to run (torch's C++ side
  left out). With ``smartswap`` among the methods, every other method's step also pauses
  SmartSwap's process-wide hooks, as the bench's rounds do, and that pause is counted in it.
* ``instructions``: machine instructions each method adds per layer over ``no swap``, counted by
  valgrind's callgrind, and the swap rows' ratio over each copying ``save_on_cpu`` row: a count
  that does not move (it leaves out cache misses, which time pays). Each method's steps run
  inside a C iterator of its own (``itertools.starmap``, ``filterfalse``, ``dropwhile``,
  ``takewhile``) and callgrind collects only inside those, so one run counts up to four methods,
  torch's import and the warm-up left out; the counted process runs with ``PYTHONHASHSEED=0``
  (hash-dependent dict layouts move the count by a few hundred per layer). Needs ``valgrind``
  and a CPython with its symbols; about three minutes.
* ``gc``: the cyclic collector's work each method causes over many steps (the other modes and
  the bench pause it), each method in a fresh process so that all start from the same heap:
  collections per generation and the collector's time per layer per step.

Methods by their short names: plain, save_on_cpu, copying, both-ways, eager, smartswap, bare
(``--methods eager,both-ways``); ``no swap`` is always measured, the reference of every figure.
``--json PATH`` writes what a mode printed, with the command and the build
(``scripts/results_page.py`` makes ``docs/results.md``'s tables from it).

Usage: PYTHONPATH=<checkout> python scripts/host_cost.py MODE [--layers N] [--steps N]
       [--methods a,b] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

import swap_pass
from swap_pass.tools.bench import host_cost
from swap_pass.tools.bench.host_cost import (
    HOST_METHODS,
    HostCostModel,
    MinimalSwapForward,
    cpu_time,
    isolated_step,
)
from swap_pass.tools.bench.measure import intra_op_threads

SHORT = {"plain": "no swap", "save_on_cpu": "torch save_on_cpu",
         "copying": "torch save_on_cpu (copying)",
         "both-ways": "torch save_on_cpu (copying both ways)", "eager": "recompute + swap (eager)",
         "smartswap": "SmartSwap", "bare": "bare copy + free (reference)"}
_REFERENCE = "no swap"
_COPYING = ("torch save_on_cpu (copying both ways)", "torch save_on_cpu (copying)")
_SWAPS = ("recompute + swap (eager)", "SmartSwap", "bare copy + free (reference)")


def build(names: list[str], layers: int) -> tuple[dict[str, host_cost._Method], torch.Tensor]:
    """The bench's methods ``names`` (``HOST_METHODS`` keys), each on a model of one seed."""
    x = torch.randn(1, 4, 8, requires_grad=True)
    built = {}
    for name in names:
        torch.manual_seed(0)
        built[name] = HOST_METHODS[name](HostCostModel(layers), x)
    return built, x


def _close(built: dict[str, host_cost._Method]) -> None:
    for method in built.values():
        method.close()


# --- time: the bench's measure -------------------------------------------------------------


def time_mode(layers: int = 32, rounds: int = 60, names: list[str] | None = None) -> dict:
    """``host_us_per_layer`` of the bench, for ``names`` (default: every method)."""
    methods = {name: HOST_METHODS[name] for name in names or HOST_METHODS}
    rows = host_cost.host_us_per_layer(layers=layers, rounds=rounds,
                                       methods={_REFERENCE: HOST_METHODS[_REFERENCE], **methods})
    return {"status": "ok", "layers": layers, "rounds": rounds, "rows": rows}


def _print_time(found: dict) -> None:
    from swap_pass.tools.bench.report import _host_lines

    print("\n".join(_host_lines(found)[1:]))


# --- stages: one layer's swap taken apart ---------------------------------------------------

_clock = time.perf_counter_ns
Stages = dict[str, list[int]]


def _lap(stages: Stages, stage: str, since: int) -> int:
    """Record the time since ``since`` under ``stage``; return now, the next lap's start."""
    now = _clock()
    stages[stage].append(now - since)
    return now


class _TimedBare(MinimalSwapForward):
    """The bench's bare reference, each of its stages timed."""

    stages: Stages = collections.defaultdict(list)

    def swap_out(self, hidden_states: torch.Tensor) -> Callable[[torch.Tensor], None]:
        stages, t = self.stages, _clock()
        storage = hidden_states.untyped_storage()
        nbytes = storage.nbytes()
        host = host_cost.bare_allocate(nbytes)
        t = _lap(stages, "bare: allocate a host buffer", t)
        host_cost.bare_copy_out(host, storage)
        t = _lap(stages, "bare: copy out", t)
        host_cost.bare_free(storage)
        _lap(stages, "bare: free", t)

        def restore(grad: torch.Tensor) -> None:
            t = _clock()
            host_cost.bare_copy_back(host, storage, nbytes)
            _lap(stages, "bare: re-allocate, copy back", t)

        return restore


class _TimedGroup(_TimedBare):
    """One ``SwapTensors`` group per layer through its public transitions, each timed."""

    def swap_out(self, hidden_states: torch.Tensor) -> Callable[[torch.Tensor], None]:
        stages, t = self.stages, _clock()
        group = swap_pass.SwapTensors([hidden_states])
        t = _lap(stages, "group: SwapTensors([x])", t)
        group.swap_to_host()
        t = _lap(stages, "group: swap_to_host()", t)
        group.wait_d2h()
        _lap(stages, "group: wait_d2h()", t)

        def restore(grad: torch.Tensor) -> None:
            t = _clock()
            group.swap_to_device()
            t = _lap(stages, "group: swap_to_device()", t)
            group.wait_h2d()
            _lap(stages, "group: wait_h2d()", t)

        return restore


def stages_mode(layers: int = 32, steps: int = 200, warmup: int = 10) -> dict:
    """Each stage's median (us) and what each way adds per layer over plain (least step, us)."""
    built, x = build([_REFERENCE, "recompute + swap (eager)"], layers)
    for name, wrapper in (("bare", _TimedBare), ("group", _TimedGroup)):
        torch.manual_seed(0)
        built[name] = host_cost.minimal_swap(HostCostModel(layers), x, forward=wrapper)
    stages = _TimedBare.stages
    times: dict[str, list[float]] = {name: [] for name in built}
    try:
        with intra_op_threads(1):
            for step in range(warmup + steps):
                if step == warmup:
                    stages.clear()
                for name, method in built.items():
                    spent = cpu_time(method.step)
                    if step >= warmup:
                        times[name].append(spent)
    finally:
        _close(built)
    medians = {name: statistics.median(ns) / 1e3 for name, ns in stages.items()}
    added = {name: (min(times[name]) - min(times[_REFERENCE])) * 1e6 / layers
             for name in ("bare", "group", "recompute + swap (eager)")}
    stages.clear()
    return {"layers": layers, "steps": steps, "stages_us": medians, "added_us_per_layer": added}


def _print_stages(found: dict) -> None:
    print(f"stages of one layer's swap, median over {found['steps']} steps, us:")
    for name, us in found["stages_us"].items():
        print(f"  {name:34s} {us:7.2f}")
    print("host CPU time added per layer over no swap (least step CPU time), us:")
    bare = found["added_us_per_layer"]["bare"]
    for name, us in found["added_us_per_layer"].items():
        print(f"  {name:34s} {us:7.1f} ({us / bare:.2f}x bare)")


# --- calls: Python bytecodes and calls -------------------------------------------------------

_Key = tuple[str, str]


def _where(code) -> _Key:
    path = code.co_filename
    for marker, keep in (("site-packages/", False), ("swap_pass/", True)):
        if marker in path:
            path = path[path.index(marker) + (0 if keep else len(marker)):]
            break
    return path, code.co_name


def _traced(step: Callable[[], None],
            steps: int) -> tuple[collections.Counter, collections.Counter]:
    """Bytecodes and calls per function over ``steps`` steps (after three untraced ones)."""
    for _ in range(3):
        step()
    opcodes: collections.Counter[_Key] = collections.Counter()
    calls: collections.Counter[_Key] = collections.Counter()

    def trace(frame, event, arg):
        if event == "opcode":
            opcodes[_where(frame.f_code)] += 1
        elif event == "call":
            frame.f_trace_opcodes = True
            calls[_where(frame.f_code)] += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
    return opcodes, calls


def calls_mode(layers: int = 32, steps: int = 2, names: list[str] | None = None,
               top: int = 15) -> dict:
    """Per method: bytecodes and calls added per layer over no swap, and the top functions."""
    names = [n for n in names or ["recompute + swap (eager)"] if n != _REFERENCE]
    built, _ = build([_REFERENCE, *names], layers)
    try:
        with intra_op_threads(1):
            counted = {name: _traced(isolated_step(built, name), steps) for name in built}
    finally:
        _close(built)
    per_layer = steps * layers
    plain_ops, plain_calls = counted[_REFERENCE]
    out = {"layers": layers, "steps": steps, "rows": {}}
    for name in names:
        ops, calls = counted[name]
        added = {k: ((ops[k] - plain_ops[k]) / per_layer, (calls[k] - plain_calls[k]) / per_layer)
                 for k in ops.keys() | plain_ops.keys()}
        largest = sorted(added.items(), key=lambda kv: -kv[1][0])[:top]
        out["rows"][name] = {
            "bytecodes": sum(b for b, _ in added.values()),
            "calls": sum(c for _, c in added.values()),
            "top": [{"where": f"{k[0]}:{k[1]}", "bytecodes": b, "calls": c}
                    for k, (b, c) in largest]}
    return out


def _print_calls(found: dict) -> None:
    for name, row in found["rows"].items():
        print(f"{name} adds per layer: {row['bytecodes']:.0f} Python bytecodes, "
              f"{row['calls']:.1f} Python calls; largest:")
        for f in row["top"]:
            print(f"  {f['bytecodes']:8.1f} bytecodes {f['calls']:6.2f} calls  {f['where']}")


# --- instructions: callgrind -----------------------------------------------------------------

# The C functions that run each method's steps (callgrind collects inside these only), and how
# each drives a step function that returns True.
_DRIVERS: list[tuple[str, Callable]] = [
    ("starmap_next", lambda fn, n: itertools.starmap(fn, [()] * n)),
    ("filterfalse_next", lambda fn, n: itertools.filterfalse(fn, range(n))),
    ("dropwhile_next", lambda fn, n: itertools.dropwhile(fn, range(n))),
    ("takewhile_next", lambda fn, n: itertools.takewhile(fn, range(n))),
]
_CHILD = "SWAP_PASS_COUNTING_CHILD"
_DEFAULT_COUNTED = [_REFERENCE, "recompute + swap (eager)", *_COPYING]


def counted_steps(layers: int, steps: int, names: list[str]) -> None:
    """The counted part (run under callgrind): warm-up, then two rounds of each method's steps,
    each method inside its own driver (``_DRIVERS``, in the order of ``names``)."""
    built, _ = build(names, layers)
    try:
        with intra_op_threads(1):
            runs = [(drive, _returning_true(isolated_step(built, name)))
                    for (_, drive), name in zip(_DRIVERS, names, strict=False)]
            for _ in range(5):
                for _, run in runs:
                    run()
            for _ in range(2):  # alternating, so that no method runs only first
                for drive, run in runs:
                    collections.deque(drive(run, steps), maxlen=0)
    finally:
        _close(built)


def _returning_true(step: Callable[[], None]) -> Callable[..., bool]:
    def run(*_: object) -> bool:
        step()
        return True

    return run


def _inclusive(out_file: str) -> dict[str, int]:
    """Each driver's instructions (inclusive), read with ``callgrind_annotate``."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", out_file], check=True,
                          capture_output=True, text=True).stdout
    drivers = {symbol for symbol, _ in _DRIVERS}
    found: dict[str, int] = {}
    for line in text.splitlines():
        match = re.search(r"^\s*([\d,]+) .*:(\w+_next)\b", line)
        if match is not None and match.group(2) in drivers:
            count = int(match.group(1).replace(",", ""))
            found[match.group(2)] = max(count, found.get(match.group(2), 0))
    return found


def instructions_mode(layers: int = 32, steps: int = 10, names: list[str] | None = None) -> dict:
    """Instructions per layer of each method, and what each adds over no swap."""
    names = [_REFERENCE, *(n for n in names or _DEFAULT_COUNTED if n != _REFERENCE)]
    if len(names) > len(_DRIVERS):
        sys.exit(f"host_cost.py instructions: {len(names)} methods given; one run counts at most "
                 f"{len(_DRIVERS)} (no swap among them).")
    missing = [tool for tool in ("valgrind", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"host_cost.py instructions: {', '.join(missing)} not found; install valgrind "
                 "(apt install valgrind) to count instructions.")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "callgrind.out")
        toggles = [f"--toggle-collect={symbol}" for symbol, _ in _DRIVERS[:len(names)]]
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
                        *toggles, sys.executable, __file__, "instructions", f"--layers={layers}",
                        f"--steps={steps}", f"--methods={','.join(names)}"], check=True,
                       env={**os.environ, _CHILD: "1", "PYTHONHASHSEED": "0"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = _inclusive(out_file)
    return instruction_rows(found, names, layers, steps)


def instruction_rows(found: dict[str, int], names: list[str], layers: int, steps: int) -> dict:
    """Per layer and over no swap, from each driver's count; the swap rows' ratios."""
    absent = [symbol for symbol, _ in _DRIVERS[:len(names)] if symbol not in found]
    if absent:
        sys.exit(f"host_cost.py instructions: callgrind counted nothing in {absent}; is this "
                 "CPython's binary stripped of its symbols?")
    per_layer = {name: found[symbol] / (2 * steps * layers)
                 for (symbol, _), name in zip(_DRIVERS, names, strict=False)}
    rows = {name: {"per_layer": n, "added": n - per_layer[_REFERENCE]}
            for name, n in per_layer.items()}
    for name, row in rows.items():
        if name in _SWAPS:
            row["over"] = {base: row["added"] / rows[base]["added"] for base in _COPYING
                           if base in rows and rows[base]["added"] > 0}
    return {"layers": layers, "steps": steps, "rows": rows}


def _print_instructions(found: dict) -> None:
    print(f"machine instructions per layer per step ({found['layers']} layers, "
          f"2 x {found['steps']} steps, callgrind):")
    for name, row in found["rows"].items():
        over = "".join(f", {r:.2f}x {base}" for base, r in row.get("over", {}).items())
        print(f"  {name:38s} {row['per_layer']:10,.0f}, adds {row['added']:9,.0f}{over}")


# --- gc: the collector over many steps -------------------------------------------------------


def collections_of(name: str, layers: int, steps: int, warmup: int = 20) -> dict:
    """Collections per generation and their time over ``steps`` steps of method ``name``."""
    counts, spent, started = [0, 0, 0], [0, 0, 0], [0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
            counts[info["generation"]] += 1
        else:
            spent[info["generation"]] += time.perf_counter_ns() - started[0]

    built, _ = build([name], layers)
    try:
        with intra_op_threads(1):
            for step in range(warmup + steps):
                if step == warmup:
                    gc.callbacks.append(on_collection)
                built[name].step()
    finally:
        if on_collection in gc.callbacks:
            gc.callbacks.remove(on_collection)
        _close(built)
    return {"counts": counts, "ms": [ns / 1e6 for ns in spent],
            "us_per_layer": sum(spent) / 1e3 / steps / layers}


def gc_mode(layers: int = 32, steps: int = 1500, names: list[str] | None = None) -> dict:
    """:func:`collections_of` for each method, each in a fresh process."""
    names = [_REFERENCE, *(n for n in names or ["recompute + swap (eager)", _COPYING[1]]
                           if n != _REFERENCE)]
    rows = {}
    for name in names:
        out = subprocess.run([sys.executable, __file__, "gc", f"--layers={layers}",
                              f"--steps={steps}", f"--methods={name}"], check=True,
                             capture_output=True, text=True,
                             env={**os.environ, _CHILD: "1"}).stdout
        rows[name] = json.loads(out.splitlines()[-1])
    return {"layers": layers, "steps": steps, "rows": rows}


def _print_gc(found: dict) -> None:
    print(f"cyclic garbage collection per method ({found['layers']} layers, {found['steps']} "
          "steps, one process each):")
    for name, row in found["rows"].items():
        (n0, n1, n2), ms = row["counts"], row["ms"]
        every = f"every {found['steps'] / n2:.0f} steps" if n2 else "none"
        print(f"  {name:38s} {n0} young, {n1} middle, {n2} full ({every}; {ms[2]:.0f} ms); "
              f"collector {row['us_per_layer']:.1f} us per layer per step")


# --- the command line ------------------------------------------------------------------------

MODES = {"time": (time_mode, _print_time), "stages": (stages_mode, _print_stages),
         "calls": (calls_mode, _print_calls),
         "instructions": (instructions_mode, _print_instructions), "gc": (gc_mode, _print_gc)}
# --steps means each mode's own count of steps (rounds for ``time``).
_STEPS = {"time": "rounds", "stages": "steps", "calls": "steps", "instructions": "steps",
          "gc": "steps"}


def method_names(text: str | None) -> list[str] | None:
    """``HOST_METHODS`` keys of a comma-separated list of short names (or of the keys)."""
    if not text:
        return None
    names = [SHORT.get(part.strip(), part.strip()) for part in text.split(",")]
    unknown = [n for n in names if n not in HOST_METHODS]
    if unknown:
        raise SystemExit(f"host_cost.py: methods {unknown} are unknown. They must be among "
                         f"{sorted(SHORT)}.")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--layers", type=int, help="tiny checkpointed layers (default: 32)")
    parser.add_argument("--steps", type=int, help="timed or counted steps (rounds for time; "
                        "defaults: time 60, stages 200, calls 2, instructions 10, gc 1500)")
    parser.add_argument("--methods", help="comma-separated short names (default: the mode's)")
    parser.add_argument("--json", help="also write the figures, command and build to this file")
    return parser


def run(argv: list[str]) -> dict:
    """Run the mode ``argv`` names; print its table; return what it measured."""
    args = _parser().parse_args(argv)
    meta = _meta(argv)  # the build and date as the measuring starts
    measure, show = MODES[args.mode]
    kwargs = {k: v for k, v in (("layers", args.layers), (_STEPS[args.mode], args.steps))
              if v is not None}
    if args.mode != "stages":
        kwargs["names"] = method_names(args.methods)
    with warnings.catch_warnings():
        # SmartSwap says once that its budget cannot be met on layers this small; these modes
        # measure host work, not memory (as the bench's host row).
        warnings.filterwarnings("ignore", message=r"swap_pass\.SmartSwap: memory_budget",
                                category=RuntimeWarning)
        found = measure(**kwargs)
    show(found)
    if args.json:
        meta["load_avg_1m"].append(round(os.getloadavg()[0], 2))
        found = {**found, "meta": meta}
        with open(args.json, "w") as f:
            json.dump(found, f, indent=2)
    return found


def _meta(argv: list[str]) -> dict:
    from swap_pass.tools.bench.run import describe_machine, source_build

    return {"command": shlex.join(["python", "scripts/host_cost.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe_machine(torch.device("cpu")),
            "torch": torch.__version__, "python": platform.python_version(),
            "build": source_build(), "load_avg_1m": [round(os.getloadavg()[0], 2)]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(_CHILD):  # a process this tool started: measure, nothing else
        args = _parser().parse_args(argv)
        names = method_names(args.methods)
        if args.mode == "instructions":
            counted_steps(args.layers, args.steps, names)
        else:
            print(json.dumps(collections_of(names[0], args.layers, args.steps)))
        return
    run(argv)


if __name__ == "__main__":
    main()
