"""Machine instructions the eager swap adds per layer, beside ``save_on_cpu``: a count that does
not move from run to run.

Host CPU time on a shared machine moves by several microseconds per layer between runs of one
build, more than most changes to the per-layer path are worth. The instructions a step executes
do not. This runs ``HostCostModel`` (tiny checkpointed layers, one intra-op thread) under
valgrind's callgrind and counts the instructions of ``--steps`` steps of each method: plain,
with ``enable_swap_layer_input``, under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(its pack hook copies out; on CPU its unpack hook copies nothing back), and under the same hooks
copying back too (``SaveOnCpuBothWays`` of ``swap_pass.bench.host_cost``, what ``save_on_cpu``
does on an accelerator; the comparator of ``scripts/host_cost_phases.py``). Each method's steps
run inside a C iterator of its own (``itertools.starmap``, ``filterfalse``, ``dropwhile``,
``takewhile``), and callgrind collects only inside those, so one run counts all four, torch's
import and the warm-up steps left out. The counted process runs with ``PYTHONHASHSEED=0``: with
hashes seeded at random, dict and set layouts differ between runs, and so does the count, by a
few hundred per layer. It prints each method's instructions per layer over plain, and the eager
one's ratio over each copying one.

Instructions are not time: they leave out cache misses, which cost the eager path more than
``save_on_cpu`` (its work is spread over more Python objects). Read the ratio beside the CPU
times of ``scripts/host_cost_phases.py``.

With ``--simulate``, callgrind also simulates the caches (sized like this machine's L1 and L2,
read from ``/sys/devices/system/cpu``) and the branch predictor, and the script prints, for each
event, what each method adds per layer and their ratio: instruction and data cache misses and
mispredicted branches are where CPU time and instructions part. Several times slower.

Needs ``valgrind`` and a CPython whose symbols are not stripped (pyenv and Debian builds keep
them). Takes about three minutes (``--simulate``: about ten).

Usage: PYTHONPATH=<checkout> python scripts/host_cost_instructions.py [--layers 32 --steps 10]
       [--simulate]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The C function that runs each method's steps: callgrind collects inside these only.
_COPYING, _BOTH_WAYS = "save_on_cpu (copying)", "save_on_cpu (copying both ways)"
_DRIVERS = {"plain": "starmap_next", "eager": "filterfalse_next", _COPYING: "dropwhile_next",
            _BOTH_WAYS: "takewhile_next"}
_CHILD = "SWAP_PASS_COUNTING_CHILD"


def _steps(layers: int, steps: int) -> None:
    """The counted part (run under callgrind): warm-up, then two rounds of each method."""
    import torch

    import swap_pass
    from swap_pass.bench.host_cost import HostCostModel, SaveOnCpuBothWays

    torch.set_num_threads(1)
    x = torch.randn(1, 4, 8, requires_grad=True)
    models = {}
    for name in _DRIVERS:
        torch.manual_seed(0)
        models[name] = HostCostModel(layers)
    handle = swap_pass.enable_swap_layer_input(models["eager"])

    def plain(*_: object) -> None:
        models["plain"](x).backward()

    def eager(*_: object) -> bool:
        models["eager"](x).backward()
        return False  # filterfalse keeps calling while this is false

    def copying(*_: object) -> bool:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = models[_COPYING](x)
        loss.backward()
        return True  # dropwhile keeps calling while this is true

    def both_ways(*_: object) -> bool:
        with SaveOnCpuBothWays():
            loss = models[_BOTH_WAYS](x)
        loss.backward()
        return True  # takewhile keeps calling while this is true

    for _ in range(5):
        plain(), eager(), copying(), both_ways()
    for _ in range(2):  # alternating, so that no method runs only first
        collections.deque(itertools.starmap(plain, [()] * steps), maxlen=0)
        collections.deque(itertools.filterfalse(eager, range(steps)), maxlen=0)
        collections.deque(itertools.dropwhile(copying, range(steps)), maxlen=0)
        collections.deque(itertools.takewhile(both_ways, range(steps)), maxlen=0)
    handle.remove()


# Events of a --simulate run, in callgrind's names, with what the table calls them.
_SIMULATED = {"Ir": "instructions", "I1mr": "L1 instruction misses", "D1mr": "L1 data read misses",
              "DLmr": "last-level data read misses", "Bcm": "mispredicted conditional branches",
              "Bim": "mispredicted indirect branches"}


def _inclusive(out_file: str, events: list[str]) -> dict[str, list[int]]:
    """Each driver's counts of ``events`` (inclusive), read with ``callgrind_annotate``."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", f"--show={','.join(events)}",
                           out_file], check=True, capture_output=True, text=True).stdout
    found: dict[str, list[int]] = {}
    for line in text.splitlines():
        match = re.search(r":(\w+_next)\b", line)
        if match is None or match.group(1) not in _DRIVERS.values():
            continue
        counts = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) \(", line)]
        if len(counts) == len(events) and counts > found.get(match.group(1), []):
            found[match.group(1)] = counts
    return found


def _cache_options() -> list[str]:
    """valgrind's ``--I1``, ``--D1`` and ``--LL`` for this machine's L1 caches and its L2 (as
    the last level: callgrind simulates two), or none where sysfs does not say."""
    caches = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, kind, size, ways, line = (
                (index / name).read_text().strip() for name in
                ("level", "type", "size", "ways_of_associativity", "coherency_line_size"))
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024 * 1024}.get(size[-1:])
        if scale is not None and size[:-1].isdigit():
            caches[(level, kind)] = f"{int(size[:-1]) * scale},{ways},{line}"
    wanted = {"--I1": ("1", "Instruction"), "--D1": ("1", "Data"), "--LL": ("2", "Unified")}
    if not all(key in caches for key in wanted.values()):
        return []
    return [f"{option}={caches[key]}" for option, key in wanted.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--simulate", action="store_true",
                        help="also simulate the caches and the branch predictor")
    args = parser.parse_args()
    if os.environ.get(_CHILD):
        _steps(args.layers, args.steps)
        return
    missing = [tool for tool in ("valgrind", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"host_cost_instructions: {', '.join(missing)} not found; install valgrind "
                 "(apt install valgrind) to count instructions.")
    events = list(_SIMULATED) if args.simulate else ["Ir"]
    simulation = (["--cache-sim=yes", "--branch-sim=yes", *_cache_options()] if args.simulate
                  else [])
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "callgrind.out")
        toggles = [f"--toggle-collect={fn}" for fn in _DRIVERS.values()]
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
                        *simulation, *toggles, sys.executable, __file__, f"--layers={args.layers}",
                        f"--steps={args.steps}"], check=True,
                       env={**os.environ, _CHILD: "1", "PYTHONHASHSEED": "0"},  # same dict layouts
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = _inclusive(out_file, events)
    absent = [fn for fn in _DRIVERS.values() if fn not in found]
    if absent:
        sys.exit(f"host_cost_instructions: callgrind counted nothing in {absent}; is this "
                 "CPython's binary stripped of its symbols?")
    _report(found, events, args.layers, args.steps, " ".join(simulation[2:]))


def _report(found: dict[str, list[int]], events: list[str], layers: int, steps: int,
            caches: str) -> None:
    """Print what each method adds per layer over plain, per event, and eager's ratios."""
    import torch

    rounds = 2 * steps * layers
    per_layer = {name: [n / rounds for n in found[fn]] for name, fn in _DRIVERS.items()}
    added = {name: [n - p for n, p in zip(per_layer[name], per_layer["plain"])]
             for name in _DRIVERS if name != "plain"}
    print(f"instructions per layer per step ({layers} layers, 2 x {steps} steps, "
          f"torch {torch.__version__}, callgrind): plain {per_layer['plain'][0]:,.0f}")
    if len(events) == 1:
        for name, extra in added.items():
            print(f"  {name:31s} adds {extra[0]:9,.0f}")
        for name in (_BOTH_WAYS, _COPYING):
            print(f"  eager / {name}: {added['eager'][0] / added[name][0]:.2f}x")
        return
    print(f"added per layer, simulated ({caches or 'valgrind default caches'}); eager's ratio "
          f"over {_BOTH_WAYS}, then over {_COPYING}:")
    for i, event in enumerate(events):
        eager, both, copying = (added[name][i] for name in ("eager", _BOTH_WAYS, _COPYING))
        ratios = "  ".join(f"{eager / n:.2f}x" if n > 0 else "-" for n in (both, copying))
        print(f"  {_SIMULATED[event]:34s} eager {eager:9,.0f}  both ways {both:8,.0f}  "
              f"copying {copying:8,.0f}  {ratios}")


if __name__ == "__main__":
    main()
