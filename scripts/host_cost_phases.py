"""Host CPU time the eager swap adds per layer, forward and backward apart.

The model is ``HostCostModel`` (tiny checkpointed layers, compute negligible), built twice from
one seed: one copy plain, one with ``enable_swap_layer_input``. Steps of the two alternate, one
intra-op thread; each phase's figure is the least process CPU time over the timed steps, minus
the plain copy's least, divided by the layer count. The least time is steadier than the median
on a shared machine; ``swap-pass bench`` reports medians of paired differences instead.

Run it once per build to compare two builds (``PYTHONPATH=<checkout> python
scripts/host_cost_phases.py``), alternating builds between runs.

Usage: python scripts/host_cost_phases.py [--layers 32 --steps 300 --warmup 10]
"""

from __future__ import annotations

import argparse
import time

import torch

import swap_pass
from swap_pass.bench.host_cost import HostCostModel
from swap_pass.bench.measure import intra_op_threads


def _phases(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    start = time.process_time()
    loss = model(x)
    mid = time.process_time()
    loss.backward()
    return mid - start, time.process_time() - mid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    x = torch.randn(1, 4, 8, requires_grad=True)
    torch.manual_seed(0)
    plain = HostCostModel(args.layers)
    torch.manual_seed(0)
    swapped = HostCostModel(args.layers)
    handle = swap_pass.enable_swap_layer_input(swapped)
    least = {"plain": [float("inf")] * 2, "swapped": [float("inf")] * 2}
    with intra_op_threads(1):
        for step in range(args.warmup + args.steps):
            for name, model in (("plain", plain), ("swapped", swapped)):
                times = _phases(model, x)
                if step >= args.warmup:
                    least[name] = [min(a, b) for a, b in zip(least[name], times)]
    handle.remove()
    fwd, bwd = ((s - p) / args.layers * 1e6 for s, p in zip(least["swapped"], least["plain"]))
    print(f"eager swap adds per layer: forward {fwd:.1f} us, backward {bwd:.1f} us, "
          f"total {fwd + bwd:.1f} us (least CPU time of {args.steps} steps, "
          f"{args.layers} layers, torch {torch.__version__})")


if __name__ == "__main__":
    main()
