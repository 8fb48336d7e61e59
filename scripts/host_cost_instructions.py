"""Machine instructions the eager swap adds per layer, beside ``save_on_cpu``: a count that does
not move from run to run.

Host CPU time on a shared machine moves by several microseconds per layer between runs of one
build, more than most changes to the per-layer path are worth. The instructions a step executes
do not. This runs ``HostCostModel`` (tiny checkpointed layers, one intra-op thread) under
valgrind's callgrind and counts the instructions of ``--steps`` steps of each method: plain,
with ``enable_swap_layer_input``, and under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(the copying comparator of ``scripts/host_cost_phases.py``). Each method's steps run inside a C
iterator of its own (``itertools.starmap``, ``filterfalse``, ``dropwhile``), and callgrind
collects only inside those, so one run counts all three, torch's import and the warm-up steps
left out. It prints each method's instructions per layer over plain, and their ratio.

Instructions are not time: they leave out cache misses, which cost the eager path more than
``save_on_cpu`` (its work is spread over more Python objects). Read the ratio beside the CPU
times of ``scripts/host_cost_phases.py``.

Needs ``valgrind`` and a CPython whose symbols are not stripped (pyenv and Debian builds keep
them). Takes about three minutes.

Usage: PYTHONPATH=<checkout> python scripts/host_cost_instructions.py [--layers 32 --steps 10]
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

# The C function that runs each method's steps: callgrind collects inside these only.
_DRIVERS = {"plain": "starmap_next", "eager": "filterfalse_next",
            "save_on_cpu (copying)": "dropwhile_next"}
_CHILD = "SWAP_PASS_COUNTING_CHILD"


def _steps(layers: int, steps: int) -> None:
    """The counted part (run under callgrind): warm-up, then two rounds of each method."""
    import torch

    import swap_pass
    from swap_pass.bench.host_cost import HostCostModel

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
            loss = models["save_on_cpu (copying)"](x)
        loss.backward()
        return True  # dropwhile keeps calling while this is true

    for _ in range(5):
        plain(), eager(), copying()
    for _ in range(2):  # alternating, so that no method runs only first
        collections.deque(itertools.starmap(plain, [()] * steps), maxlen=0)
        collections.deque(itertools.filterfalse(eager, range(steps)), maxlen=0)
        collections.deque(itertools.dropwhile(copying, range(steps)), maxlen=0)
    handle.remove()


def _inclusive(out_file: str) -> dict[str, int]:
    """Instructions inside each driver, read with ``callgrind_annotate --inclusive=yes``."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", out_file], check=True,
                          capture_output=True, text=True).stdout
    found: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"\s*([\d,]+)\s.*:(\w+_next)\b", line)
        if match and match.group(2) in _DRIVERS.values():
            count = int(match.group(1).replace(",", ""))
            found[match.group(2)] = max(found.get(match.group(2), 0), count)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if os.environ.get(_CHILD):
        _steps(args.layers, args.steps)
        return
    missing = [tool for tool in ("valgrind", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"host_cost_instructions: {', '.join(missing)} not found; install valgrind "
                 "(apt install valgrind) to count instructions.")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "callgrind.out")
        toggles = [f"--toggle-collect={fn}" for fn in _DRIVERS.values()]
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
                        *toggles, sys.executable, __file__, f"--layers={args.layers}",
                        f"--steps={args.steps}"], check=True, env={**os.environ, _CHILD: "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = _inclusive(out_file)
    absent = [fn for fn in _DRIVERS.values() if fn not in found]
    if absent:
        sys.exit(f"host_cost_instructions: callgrind counted nothing in {absent}; is this "
                 "CPython's binary stripped of its symbols?")
    per_layer = {name: found[fn] / (2 * args.steps * args.layers) for name, fn in _DRIVERS.items()}
    import torch

    print(f"instructions per layer per step ({args.layers} layers, 2 x {args.steps} steps, "
          f"torch {torch.__version__}, callgrind): plain {per_layer['plain']:,.0f}")
    added = {name: per_layer[name] - per_layer["plain"] for name in _DRIVERS if name != "plain"}
    for name, extra in added.items():
        print(f"  {name:22s} adds {extra:9,.0f}")
    print(f"  eager / save_on_cpu (copying): {added['eager'] / added['save_on_cpu (copying)']:.2f}x")


if __name__ == "__main__":
    main()
