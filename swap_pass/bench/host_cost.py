"""Host CPU time that each way of keeping activations adds per layer, compute left out.

The model is ``layers`` checkpointed layers of a few hundred FLOPs each (hidden 8, 4 tokens), so
a step's CPU time is almost all host work: PyTorch's dispatch and autograd, plus what the
method adds (hooks, bookkeeping, copies of a few bytes). On an accelerator the launch queue
hides host time only while the host stays ahead of the device; with small layers or many
micro-batches the host cost is the overhead users see.

Method: one intra-op thread; every method's model built from the same seed; warm-up steps;
then ``rounds`` rounds, each running one step of every method in turn (paired, so load that
comes and goes hits all of them alike). A method's figure is the median over rounds of its
step's process CPU time minus the no-swap step's in the same round, divided by ``layers``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from swap_pass.bench.measure import intra_op_threads

__all__ = ["HOST_METHODS", "HostCostModel", "host_us_per_layer"]


class _TinyLayer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + torch.tanh(self.lin(hidden_states))


class HostCostModel(nn.Module):
    """``layers`` checkpointed tiny layers in ``self.layers``; returns the sum of the output.

    Args:
        layers: Number of layers. Default: ``32``.
        hidden: Width of each layer. Default: ``8``.
    """

    def __init__(self, layers: int = 32, hidden: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_TinyLayer(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x.sum()


def _plain(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    return (lambda: model(x).backward()), (lambda: None)


def _save_on_cpu(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    def step() -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            loss = model(x)
        loss.backward()

    return step, (lambda: None)


def _eager(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    import swap_pass

    handle = swap_pass.enable_swap_layer_input(model)
    return (lambda: model(x).backward()), handle.remove


def _smartswap(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    import swap_pass

    smart = swap_pass.SmartSwap(model, memory_budget=0.25)
    smart.__enter__()
    # SmartSwap's saved-tensor hooks are process-wide: left on, they would also pack the other
    # methods' tensors in the interleaved rounds (keeping their storages alive and shared). So
    # they are on only around this method's own forward; unpacking is bound at pack time.
    hooks = smart._hooks
    hooks.__exit__(None, None, None)

    def step() -> None:
        with hooks:
            loss = model(x)
        loss.backward()
        smart.step()

    def close() -> None:
        hooks.__enter__()  # close() takes them off again
        smart.close()

    return step, close


HOST_METHODS: dict[str, Callable] = {
    "no swap": _plain,
    "torch save_on_cpu": _save_on_cpu,
    "recompute + swap (eager)": _eager,
    "SmartSwap": _smartswap,
}


def _cpu_time(fn: Callable[[], None]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def host_us_per_layer(layers: int = 32, rounds: int = 30, warmup: int = 5,
                      methods: dict[str, Callable] | None = None) -> dict[str, dict]:
    """Each method's added host CPU time per layer per step (microseconds), and its spread.

    Returns:
        ``{method: {"us_per_layer": median paired difference / layers, "step_cpu_ms": median
        step CPU time, "iqr_us_per_layer": interquartile range of the paired differences}}``;
        ``"no swap"`` is the reference (0 by definition).
    """
    import swap_pass

    methods = methods or HOST_METHODS
    x = torch.randn(1, 4, 8, requires_grad=True)
    steps, closers = {}, []
    with intra_op_threads(1):
        for name, build in methods.items():
            torch.manual_seed(0)
            steps[name], close = build(HostCostModel(layers), x)
            closers.append(close)
        try:
            times = _rounds(steps, rounds, warmup)
        finally:
            for close in closers:
                close()
            swap_pass.reset()
    return _summarize(times, layers)


def _rounds(steps: dict[str, Callable[[], None]], rounds: int, warmup: int) -> dict[str, list[float]]:
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_cpu_time(step))
    return times


def _summarize(times: dict[str, list[float]], layers: int) -> dict[str, dict]:
    ref = times["no swap"]
    out = {}
    for name, ts in times.items():
        diffs = sorted((t - r) / layers * 1e6 for t, r in zip(ts, ref))
        q1, q3 = statistics.quantiles(diffs, n=4)[0], statistics.quantiles(diffs, n=4)[2]
        out[name] = {"us_per_layer": statistics.median(diffs), "iqr_us_per_layer": q3 - q1,
                     "step_cpu_ms": statistics.median(ts) * 1e3}
    return out
