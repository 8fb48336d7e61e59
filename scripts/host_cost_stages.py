"""Host time of each stage of one layer's swap: a ``SwapTensors`` group against the bare floor.

``scripts/host_cost_phases.py`` times whole forward and backward passes. This splits the swap of
one layer input into its stages and times each with ``time.perf_counter_ns`` around it, inside a
real step of ``HostCostModel`` (tiny checkpointed layers, one intra-op thread), so each stage runs
in the state the layer's own compute leaves the caches in, as in training. Two wrappers swap each
inner layer's input right after the layer ran and restore it in a gradient hook on its output:

* ``bare``: what ``swap-pass bench`` calls "bare copy + free (reference)": a fresh host buffer,
  a copy out through a byte view, a free; back: a resize and a copy through a byte view.
* ``group``: one :class:`swap_pass.SwapTensors` per layer through its public transitions
  (construction, ``swap_to_host``, ``wait_d2h``; back: ``swap_to_device``, ``wait_h2d``), with
  every rule the runtime keeps (validity check, host buffer pool, one live group per storage,
  in-place write check, freed-tensor guard, counters).

It prints each stage's median over the steps, then the host CPU time that each wrapper and
``enable_swap_layer_input`` (the group plus the eager protocol: ownership check, backward guard,
previous-layer bookkeeping, prefetch) add per layer over the plain model: the least step CPU
time over the steps, the collector paused in each as ``swap-pass bench`` pauses it.

Usage: PYTHONPATH=<checkout> python scripts/host_cost_stages.py [--layers 32 --steps 200]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.bench.host_cost import HostCostModel, _cpu_time
from swap_pass.bench.measure import intra_op_threads

_clock = time.perf_counter_ns
_in_backward = torch._C._current_graph_task_id  # -1 outside backward: the recompute passes
Stages = dict[str, list[int]]


class _Timed:
    """A layer's forward, then its input swapped out by ``swap``; the stages go to ``stages``."""

    def __init__(self, layer: torch.nn.Module, stages: Stages, name: str,
                 swap: Callable[[torch.Tensor, Stages], Callable[[torch.Tensor], None]]) -> None:
        self.forward = type(layer).forward.__get__(layer)
        self.stages = stages
        self.hook_stage = f"{name}: register the hook"
        self.swap = swap

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.forward(hidden_states)
        if _in_backward() != -1:
            return out
        restore = self.swap(hidden_states, self.stages)
        t = _clock()
        out.register_hook(restore)
        _lap(self.stages, self.hook_stage, t)
        return out


def _lap(stages: Stages, stage: str, since: int) -> int:
    """Record the time since ``since`` under ``stage``; return now, the next lap's start."""
    now = _clock()
    stages[stage].append(now - since)
    return now


def _bare(x: torch.Tensor, stages: Stages) -> Callable[[torch.Tensor], None]:
    t = _clock()
    storage = x.untyped_storage()
    nbytes = storage.nbytes()
    host = torch.empty(nbytes, dtype=torch.uint8)
    t = _lap(stages, "bare: allocate", t)
    host.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    t = _lap(stages, "bare: copy out", t)
    storage.resize_(0)
    _lap(stages, "bare: free", t)

    def restore(grad: torch.Tensor) -> None:
        t = _clock()
        storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(storage).copy_(host)
        _lap(stages, "bare: re-allocate, copy back", t)

    return restore


def _group(x: torch.Tensor, stages: Stages) -> Callable[[torch.Tensor], None]:
    t = _clock()
    group = SwapTensors([x])
    t = _lap(stages, "group: SwapTensors()", t)
    group.swap_to_host()
    t = _lap(stages, "group: swap_to_host", t)
    group.wait_d2h()
    _lap(stages, "group: wait_d2h", t)

    def restore(grad: torch.Tensor) -> None:
        t = _clock()
        group.swap_to_device()
        t = _lap(stages, "group: swap_to_device", t)
        group.wait_h2d()
        _lap(stages, "group: wait_h2d", t)

    return restore


def _models(layers: int, stages: Stages) -> tuple[dict[str, torch.nn.Module], Callable[[], None]]:
    """The plain model and one per way of swapping, from one seed; and what undoes the eager one."""
    models = {}
    for name in ("plain", "bare", "group", "eager"):
        torch.manual_seed(0)
        models[name] = HostCostModel(layers)
    for name, swap in (("bare", _bare), ("group", _group)):
        for layer in list(models[name].layers)[1:-1]:  # not the first (its input is the
            # caller's) nor the last, as the bench's bare reference
            object.__setattr__(layer, "forward", _Timed(layer, stages, name, swap))
    return models, swap_pass.enable_swap_layer_input(models["eager"]).remove


def measure(layers: int = 32, steps: int = 200, warmup: int = 10) -> tuple[dict[str, float], dict[str, float]]:
    """Each stage's median in us, and each way's added host CPU time per layer in us.

    Args:
        layers: Tiny checkpointed layers of the model. Default: ``32``.
        steps: Timed steps of each model, the models alternating. Default: ``200``.
        warmup: Untimed steps of each model first. Default: ``10``.
    """
    x = torch.randn(1, 4, 8, requires_grad=True)
    stages: Stages = collections.defaultdict(list)
    models, remove = _models(layers, stages)
    times: dict[str, list[float]] = {name: [] for name in models}
    try:
        with intra_op_threads(1):
            for step in range(warmup + steps):
                if step == warmup:
                    stages.clear()
                for name, model in models.items():
                    spent = _cpu_time(lambda: model(x).backward())
                    if step >= warmup:
                        times[name].append(spent)
    finally:
        remove()
    medians = {name: statistics.median(ns) / 1e3 for name, ns in stages.items()}
    added = {name: (min(times[name]) - min(times["plain"])) * 1e6 / layers
             for name in models if name != "plain"}
    return medians, added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    medians, added = measure(args.layers, args.steps)
    print(f"stages of one layer's swap, median over {args.steps} steps ({args.layers} layers, "
          f"torch {torch.__version__}), us:")
    for name, us in medians.items():
        print(f"  {name:32s} {us:6.2f}")
    print("host CPU time added per layer over plain (least step CPU time of the steps), us:")
    for name, us in added.items():
        print(f"  {name:6s} {us:6.1f} ({us / added['bare']:.2f}x bare)")


if __name__ == "__main__":
    main()
