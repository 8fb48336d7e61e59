"""Cyclic garbage collection each way of keeping activations costs per layer, over many steps.

``swap-pass bench``'s host row pauses the collector in its timed steps: a collection costs
whichever step it falls in, so it reads as noise there. Over a run it is not noise. Each
collection of the young generations walks the objects alive at that moment and moves the
survivors on; the more objects survive, the sooner a full collection of the whole heap comes,
and on a process that has imported torch a full collection takes a hundred milliseconds or more.
A method whose per-layer objects live from forward to backward makes those come sooner.

This runs ``HostCostModel`` (tiny checkpointed layers, one intra-op thread) for ``--steps``
steps per method, each method in a fresh process (``sys.executable``) so that every method
starts from the same heap: plain, with ``enable_swap_layer_input``, and under
``torch.autograd.graph.save_on_cpu(pin_memory=True)``. ``gc.callbacks`` times every collection.
It prints, per method, the collections of each generation, the steps per full collection and
the collector's time per layer per step.

Usage: PYTHONPATH=<checkout> python scripts/host_cost_gc.py [--layers 32 --steps 1500]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import time

_METHODS = ("plain", "eager", "save_on_cpu (copying)")


def _measure(method: str, layers: int, steps: int, warmup: int = 20) -> dict:
    """Collections per generation and their time over ``steps`` steps of ``method``."""
    import torch

    import swap_pass
    from swap_pass.bench.host_cost import HostCostModel
    from swap_pass.bench.measure import intra_op_threads

    counts, spent, started = [0, 0, 0], [0, 0, 0], [0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
            counts[info["generation"]] += 1
        else:
            spent[info["generation"]] += time.perf_counter_ns() - started[0]

    torch.manual_seed(0)
    model, x = HostCostModel(layers), torch.randn(1, 4, 8, requires_grad=True)
    if method == "eager":
        swap_pass.enable_swap_layer_input(model)
    around = ((lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
              if method == "save_on_cpu (copying)" else contextlib.nullcontext)
    with intra_op_threads(1):
        for step in range(warmup + steps):
            if step == warmup:
                gc.callbacks.append(on_collection)
            with around():
                loss = model(x)
            loss.backward()
    gc.callbacks.remove(on_collection)
    return {"counts": counts, "ms": [ns / 1e6 for ns in spent],
            "us_per_layer": sum(spent) / 1e3 / steps / layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--method", choices=_METHODS, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.method is not None:
        print(json.dumps(_measure(args.method, args.layers, args.steps)))
        return
    import torch

    print(f"cyclic garbage collection per method ({args.layers} layers, {args.steps} steps, "
          f"one process each, torch {torch.__version__}):")
    for method in _METHODS:
        out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers),
                              "--steps", str(args.steps), "--method", method],
                             check=True, capture_output=True, text=True).stdout
        found = json.loads(out.splitlines()[-1])
        (n0, n1, n2), ms = found["counts"], found["ms"]
        every = f"every {args.steps / n2:.0f} steps" if n2 else "none"
        print(f"  {method:22s} collections: {n0} young, {n1} middle, {n2} full ({every}; "
              f"{ms[2]:.0f} ms); collector {found['us_per_layer']:.1f} us per layer per step")


if __name__ == "__main__":
    main()
