"""Host CPU time that each way of keeping activations adds per layer, compute left out.

The model is ``layers`` checkpointed layers of a few hundred FLOPs each (hidden 8, 4 tokens), so
a step's CPU time is almost all host work: PyTorch's dispatch and autograd, plus what the
method adds (hooks, bookkeeping, copies of a few bytes). On an accelerator the launch queue
hides host time only while the host stays ahead of the device; with small layers or many
micro-batches the host cost is the overhead users see.

Method: one intra-op thread; every method's model built from the same seed; warm-up steps;
then ``rounds`` rounds. A round times one step of every method, in an order shuffled per round
(seeded), each paired with a no-swap step timed right before it: load that comes and goes hits
both alike. Each timed step follows an untimed step of its own method, as a step follows a step
of the same method in training: timed right after another method's step, a method whose work is
spread over more code and objects pays for caches the other left cold, and the figures moved by
half between runs (``save_on_cpu (copying)`` read 22-43 us per layer in three runs, against
19-20 us when each step follows its own). A method's figure is the median over rounds of its
step's process CPU time minus its pair's, divided by ``layers``. The cyclic garbage collector
is paused during each timed step, as ``timeit`` pauses it, and the young generation collected
before it: a collection costs whichever step it falls in (about 50 us for a young one, 120-140
ms for a full one on this model, against differences of a few hundred us per step). What a
method adds to collection over many steps is ``scripts/host_cost.py gc``'s to measure.

Reading the rows on CPU: ``torch save_on_cpu`` packs each layer's input with ``tensor.cpu()``,
which for a CPU tensor is the tensor itself (no copy, nothing freed), so its figure is the cost
of two hook calls. ``torch save_on_cpu (copying)`` is ``save_on_cpu(pin_memory=True)``: its pack
hook allocates a host tensor and copies the saved tensor into it, as it does on an accelerator
(pinning falls back to pageable memory without one); its unpack hook is ``.to("cpu")``, which
copies nothing back on CPU. ``torch save_on_cpu (copying both ways)`` (:class:`SaveOnCpuBothWays`)
also copies back, as the same hook does on an accelerator: it makes the allocations and copies
that a swap makes, so it is the row to read the swap rows against on CPU.
``bare copy + free (reference)`` is the least any layer-input swap does in
Python (a copy out, a free, a gradient hook that copies back), with none of the safety; it is the
floor under the eager row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from swap_pass.tools.bench.measure import intra_op_threads

__all__ = ["HOST_METHODS", "HostCostModel", "MinimalSwapForward", "SaveOnCpuBothWays",
           "bare_allocate", "bare_copy_back", "bare_copy_out", "bare_free", "cpu_time",
           "host_us_per_layer", "isolated_step", "minimal_swap"]


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


@dataclasses.dataclass
class _Method:
    """One way of keeping activations, built on its own model.

    Attributes:
        step: One training step (forward and backward).
        close: Undo what the method changed. Default: nothing.
        around_others: A context manager factory entered around every *other* method's steps
            (SmartSwap's hooks apply to every graph built while it is active). Default: ``None``.
    """

    step: Callable[[], None]
    close: Callable[[], None] = lambda: None
    around_others: Callable[[], contextlib.AbstractContextManager] | None = None


def _plain(model: nn.Module, x: torch.Tensor) -> _Method:
    return _Method(lambda: model(x).backward())


def _unpack_copying(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    """``save_on_cpu``'s unpack hook with ``copy=True``: a fresh tensor even on the same device."""
    device, tensor = packed
    return tensor.to(device, non_blocking=True, copy=True)


class SaveOnCpuBothWays(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu(pin_memory=True)`` that copies back on CPU too, as it does on an accelerator.

    On an accelerator ``save_on_cpu``'s unpack hook, ``tensor.to(device, non_blocking=True)``,
    allocates device memory and copies the saved tensor into it: with the pack hook's copy out,
    two allocations and two copies per saved tensor, as a swap makes. On CPU the same call returns
    the host tensor itself, so only the copy out happens. Here the unpack hook passes
    ``copy=True``, its one difference from torch's: a CPU run then makes the calls an accelerator
    run makes (pageable memory instead of pinned).
    """

    def __init__(self) -> None:
        super().__init__(pin_memory=True)
        self.unpack_hook = _unpack_copying


def _save_on_cpu(hooks: Callable[[], torch.autograd.graph.saved_tensors_hooks]
                 ) -> Callable[[nn.Module, torch.Tensor], _Method]:
    def build(model: nn.Module, x: torch.Tensor) -> _Method:
        def step() -> None:
            with hooks():
                loss = model(x)
            loss.backward()

        return _Method(step)

    return build


def _eager(model: nn.Module, x: torch.Tensor) -> _Method:
    import swap_pass

    handle = swap_pass.enable_swap_layer_input(model)
    return _Method(lambda: model(x).backward(), handle.remove)


def _smartswap(model: nn.Module, x: torch.Tensor) -> _Method:
    import swap_pass

    smart = swap_pass.SmartSwap(model, memory_budget=0.25)
    smart.__enter__()

    def step() -> None:
        model(x).backward()
        smart.step()

    return _Method(step, smart.close, smart.paused)


def bare_allocate(nbytes: int) -> torch.Tensor:
    """The bare reference's first stage: a fresh host buffer of ``nbytes`` bytes."""
    return torch.empty(nbytes, dtype=torch.uint8)


def bare_copy_out(host: torch.Tensor, storage: torch.UntypedStorage) -> None:
    """The bare reference's copy out: ``storage``'s bytes into ``host`` through a byte view."""
    host.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))


def bare_free(storage: torch.UntypedStorage) -> None:
    """The bare reference's free: the storage resized to nothing."""
    storage.resize_(0)


def bare_copy_back(host: torch.Tensor, storage: torch.UntypedStorage, nbytes: int) -> None:
    """The bare reference's way back: the storage re-allocated, ``host``'s bytes copied in."""
    storage.resize_(nbytes)
    torch.empty(0, dtype=torch.uint8).set_(storage).copy_(host)


class MinimalSwapForward:
    """A block's forward that swaps its input the barest way: see :func:`minimal_swap`.

    Its stages are the ``bare_*`` functions of this module, so that a tool timing them one by
    one (``scripts/host_cost.py stages``) times this reference and no copy of it.
    """

    def __init__(self, layer: nn.Module) -> None:
        self.forward = type(layer).forward.__get__(layer)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.forward(hidden_states)
        if torch._C._current_graph_task_id() != -1:  # recomputation in backward
            return out
        out.register_hook(self.swap_out(hidden_states))
        return out

    def swap_out(self, hidden_states: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """Copy the input out and free it; return the gradient hook that brings it back."""
        storage = hidden_states.untyped_storage()
        nbytes = storage.nbytes()
        host = bare_allocate(nbytes)
        bare_copy_out(host, storage)
        bare_free(storage)

        def restore(grad: torch.Tensor) -> None:
            bare_copy_back(host, storage, nbytes)

        return restore


def minimal_swap(model: nn.Module, x: torch.Tensor,
                 forward: type[MinimalSwapForward] = MinimalSwapForward) -> _Method:
    """A reference, not a way to train: the least a layer-input swap does in Python per layer.

    Each inner layer's input is copied to a fresh host buffer and its storage freed after the
    layer ran; a gradient hook on the layer's output re-allocates it and copies the bytes back.
    Nothing else: no streams or events, no ownership rule, no guard against reading freed data,
    no buffer pool, no prefetch. The first layer (its input is the caller's) and the last are
    left alone, as the eager protocol leaves the last.

    Args:
        model: A :class:`HostCostModel`.
        x: Its input.
        forward: The wrapper each inner layer gets. Default: :class:`MinimalSwapForward`.
    """
    for layer in list(model.layers)[1:-1]:
        object.__setattr__(layer, "forward", forward(layer))

    def close() -> None:
        for layer in model.layers:
            layer.__dict__.pop("forward", None)

    return _Method(lambda: model(x).backward(), close)


HOST_METHODS: dict[str, Callable[[nn.Module, torch.Tensor], _Method]] = {
    "no swap": _plain,
    "torch save_on_cpu": _save_on_cpu(torch.autograd.graph.save_on_cpu),
    "torch save_on_cpu (copying)": _save_on_cpu(
        functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=True)),
    "torch save_on_cpu (copying both ways)": _save_on_cpu(SaveOnCpuBothWays),
    "recompute + swap (eager)": _eager,
    "SmartSwap": _smartswap,
    "bare copy + free (reference)": minimal_swap,
}


_REFERENCE = "no swap"


def cpu_time(fn: Callable[[], None]) -> float:
    """Process CPU time of ``fn()``, the cyclic collector paused (see the module's docstring)."""
    collecting = gc.isenabled()
    gc.collect(0)  # the young garbage of the steps before is theirs
    gc.disable()
    try:
        t = time.process_time()
        fn()
        return time.process_time() - t
    finally:
        if collecting:
            gc.enable()


def host_us_per_layer(layers: int = 32, rounds: int = 60, warmup: int = 5,
                      methods: dict[str, Callable] | None = None, seed: int = 0) -> dict[str, dict]:
    """Each method's added host CPU time per layer per step (microseconds), and its spread.

    Args:
        layers: Tiny checkpointed layers of the model. Default: ``32``.
        rounds: Rounds of paired steps the medians are taken over. Default: ``60``.
        warmup: Steps of each method before the rounds. Default: ``5``.
        methods: ``{name: builder}``, ``"no swap"`` among them. Default: :data:`HOST_METHODS`.
        seed: Seeds the order of the methods in each round. Default: ``0``.

    Returns:
        ``{method: {"us_per_layer": median paired difference / layers, "step_cpu_ms": median
        step CPU time, "iqr_us_per_layer": interquartile range of the paired differences}}``;
        ``"no swap"`` is the reference (0 by definition).
    """
    import swap_pass

    methods = methods or HOST_METHODS
    x = torch.randn(1, 4, 8, requires_grad=True)
    built: dict[str, _Method] = {}
    with intra_op_threads(1):
        try:
            for name, build in methods.items():
                torch.manual_seed(0)
                built[name] = build(HostCostModel(layers), x)
            diffs, steps = _rounds(built, rounds, warmup, random.Random(seed))
        finally:
            for method in built.values():
                method.close()
            swap_pass.reset()
    return _summarize(diffs, steps, layers)


def isolated_step(built: dict[str, _Method], name: str) -> Callable[[], None]:
    """``name``'s step with every other method's ``around_others`` entered around it (entering
    them is part of the step: for a tool that counts, not for the timed rounds)."""
    others = [m.around_others for other, m in built.items()
              if other != name and m.around_others is not None]
    step = built[name].step
    if not others:
        return step

    def run() -> None:
        with contextlib.ExitStack() as stack:
            for around in others:
                stack.enter_context(around())
            step()

    return run


def _timed(built: dict[str, _Method], name: str) -> float:
    """Process CPU time of one step of ``name``, the other methods' contexts entered around it."""
    with contextlib.ExitStack() as others:
        for other, method in built.items():
            if other != name and method.around_others is not None:
                others.enter_context(method.around_others())
        return cpu_time(built[name].step)


def _rounds(built: dict[str, _Method], rounds: int, warmup: int,
            rng: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each method's paired differences and its steps' CPU times (see the module's docstring)."""
    for name in built:
        for _ in range(warmup):
            _timed(built, name)
    order = [name for name in built if name != _REFERENCE]
    diffs: dict[str, list[float]] = {name: [] for name in built}
    steps: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            _timed(built, _REFERENCE)  # each timed step follows one of its own method
            ref = _timed(built, _REFERENCE)
            _timed(built, name)
            t = _timed(built, name)
            diffs[name].append(t - ref)
            diffs[_REFERENCE].append(0.0)
            steps[name].append(t)
            steps[_REFERENCE].append(ref)
    return diffs, steps


def _summarize(diffs: dict[str, list[float]], steps: dict[str, list[float]],
               layers: int) -> dict[str, dict]:
    out = {}
    for name, ds in diffs.items():
        per_layer = [d / layers * 1e6 for d in ds]
        q1, _, q3 = statistics.quantiles(per_layer, n=4)
        out[name] = {"us_per_layer": statistics.median(per_layer), "iqr_us_per_layer": q3 - q1,
                     "step_cpu_ms": statistics.median(steps[name]) * 1e3}
    return out
