"""Host CPU time the eager swap adds per layer, forward and backward apart, beside torch's own.

The model is ``HostCostModel`` (tiny checkpointed layers, compute negligible), built once per
method from one seed: plain, with ``enable_swap_layer_input``, under
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (its pack hook copies each saved tensor to
a fresh host tensor, so it does a copy out per layer like a swap), under the same hooks copying
back as well (``SaveOnCpuBothWays`` of ``swap_pass.bench.host_cost``: what ``save_on_cpu`` does
on an accelerator, the row the ratios are read against), and with the bare
copy-and-free reference of ``swap-pass bench`` (no safety; the floor under the eager row). Steps
of the methods alternate, one intra-op thread; each phase's figure is the least process CPU time
over the timed steps, minus the plain model's least, divided by the layer count. The last column
is the median, over the steps, of each step's total minus the plain step's of the same round (as
``swap-pass bench`` reports it): the least time of each phase moves less for the large rows, the
paired median less for the small ones.

Run it once per build to compare two builds (``PYTHONPATH=<checkout> python
scripts/host_cost_phases.py``), alternating builds between runs.

Usage: python scripts/host_cost_phases.py [--layers 32 --steps 300 --warmup 10]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch

import swap_pass
from swap_pass.bench.host_cost import HostCostModel, SaveOnCpuBothWays, minimal_swap
from swap_pass.bench.measure import intra_op_threads

_COPYING = "save_on_cpu (copying)"
_BOTH_WAYS = "save_on_cpu (copying both ways)"


def _phases(model: torch.nn.Module, x: torch.Tensor,
            around_forward: Callable[[], contextlib.AbstractContextManager]) -> tuple[float, float]:
    start = time.process_time()
    with around_forward():
        loss = model(x)
    mid = time.process_time()
    loss.backward()
    return mid - start, time.process_time() - mid


def _build(layers: int, x: torch.Tensor) -> tuple[dict, list[Callable[[], None]]]:
    """``{name: (model, context around its forward)}`` and what undoes the patches."""
    models = {}
    for name in ("plain", "eager", _COPYING, _BOTH_WAYS, "bare"):
        torch.manual_seed(0)
        models[name] = HostCostModel(layers)
    closers = [swap_pass.enable_swap_layer_input(models["eager"]).remove,
               minimal_swap(models["bare"], x).close]
    methods = {name: (model, contextlib.nullcontext) for name, model in models.items()}
    methods[_COPYING] = (models[_COPYING],
                         lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    methods[_BOTH_WAYS] = (models[_BOTH_WAYS], SaveOnCpuBothWays)
    return methods, closers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    x = torch.randn(1, 4, 8, requires_grad=True)
    methods, closers = _build(args.layers, x)
    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    try:
        with intra_op_threads(1):
            for step in range(args.warmup + args.steps):
                for name, (model, around_forward) in methods.items():
                    times = _phases(model, x, around_forward)
                    if step >= args.warmup:
                        steps[name].append(times)
    finally:
        for close in closers:
            close()
    us = 1e6 / args.layers
    least = {name: [min(t[i] for t in ts) for i in (0, 1)] for name, ts in steps.items()}
    added = {name: [(s - p) * us for s, p in zip(least[name], least["plain"])]
             for name in methods if name != "plain"}
    paired = {name: statistics.median((sum(t) - sum(p)) * us
                                      for t, p in zip(steps[name], steps["plain"]))
              for name in added}
    both_ways = sum(added[_BOTH_WAYS])
    print(f"host CPU time added per layer over plain (least of {args.steps} steps, "
          f"{args.layers} layers, torch {torch.__version__}; last column: median of the "
          "steps' paired differences; ratios over save_on_cpu copying both ways):")
    for name, (fwd, bwd) in added.items():
        print(f"  {name:<31} forward {fwd:6.1f} us, backward {bwd:6.1f} us, "
              f"total {fwd + bwd:6.1f} us ({(fwd + bwd) / both_ways:4.1f}x); "
              f"paired {paired[name]:6.1f} us ({paired[name] / paired[_BOTH_WAYS]:4.1f}x)")


if __name__ == "__main__":
    main()
