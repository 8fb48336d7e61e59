"""Copy windows per way in, measured on the test accelerator: how much compute each side-stream
copy can hide behind, in layers.

A window is the compute issued on the stream that waits for a copy, from the copy's start to that
wait (:func:`swap_pass.testing.accelerator.record_copy_windows`): on a device, the work the copy
overlaps. Each way in trains the same Llama-style model (checkpointed layers, but
``apply_swap_pass``, whose traced graph runs without) for a warm-up step, then one recorded step.
A layer is counted in the way's own compute: in layer-input mode one copy out starts per layer
and one prefetch per layer's backward, so the median distance between consecutive starts is one
layer's forward (copies out) or backward (copies back); SmartSwap, which swaps other saved
tensors, is counted in the layers of the eager protocol, whose ops it runs. Under Inductor a
layer's count of kernels may differ by one where a kernel fuses across a layer boundary.

The first copy back of a backward in the eager protocol (``enable``, the decorators,
``compile_layers``) and in ``apply_swap_pass`` is a restore, not a prefetch: the last swapped
layer input is read by the first guard of the backward (Note: [Readers outside the layer] in
``swap_pass/eager/_protocol.py``), and its window is empty. ``prefetches`` leaves it out.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

from swap_pass.tools.models import (
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaStyleModel,
    TraceableLlama,
    make_batch,
)

__all__ = ["WAYS", "WindowRow", "format_windows", "measure_windows"]

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=6, num_heads=2, intermediate_size=48)
WAYS = ("enable", "decorators", "apply_swap_pass", "swap_backend[aot_eager]",
        "swap_backend[inductor]", "compile_layers", "smartswap")


@dataclasses.dataclass
class WindowRow:
    """One way in's windows, in layers of its own compute (see the module's docstring).

    Attributes:
        way: The way in.
        d2h: Each copy out's window, in layer forwards.
        h2d: Each copy back's window, in layer backwards, in the order the copies started.
        prefetches: ``h2d`` without the restores the backward's first guard waits for at once.
        layer_ops: Ops of one layer's forward and backward, as counted (the unit).
        note: Why the row is empty, or what to read in it.
    """

    way: str
    d2h: list[float]
    h2d: list[float]
    prefetches: list[float]
    layer_ops: tuple[float, float]
    note: str = ""


def _decorated(model: LlamaStyleModel) -> LlamaStyleModel:
    """The model with MindSpeed's decorators on its layers' ``__init__`` and ``forward``."""
    from swap_pass import swap_layer_input_forward_wrapper, swap_layer_input_init_wrapper

    class DecoratedLayer(LlamaDecoderLayer):
        @swap_layer_input_init_wrapper
        def __init__(self, cfg: LlamaConfig) -> None:
            super().__init__(cfg)

        @swap_layer_input_forward_wrapper
        def forward(self, hidden_states, cos, sin):
            return super().forward(hidden_states, cos, sin)

    device = model.embed.weight.device
    for i, old in enumerate(model.layers):
        layer = DecoratedLayer(model.cfg).to(device)
        layer.load_state_dict(old.state_dict())
        model.layers[i] = layer
    return model


def _nothing() -> None:
    return None


def _traced_forward(model: LlamaStyleModel) -> Callable:
    """``apply_swap_pass`` on the traced model, called as the model is."""
    import swap_pass

    gm = swap_pass.apply_swap_pass(torch.fx.symbolic_trace(TraceableLlama(model)))

    def forward(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        return gm(ids, model.cos_table.narrow(0, 0, seq), model.sin_table.narrow(0, 0, seq),
                  labels)

    return forward


def _way(way: str, model: LlamaStyleModel) -> tuple[Callable, Callable[[], None], object]:
    """``(step, close, smart)``: one training step of ``model`` through ``way``."""
    import swap_pass

    smart, close, forward = None, _nothing, model
    if way == "enable":
        close = swap_pass.enable_swap_layer_input(model).remove
    elif way == "decorators":
        _decorated(model)
    elif way == "apply_swap_pass":
        forward = _traced_forward(model)
    elif way.startswith("swap_backend["):
        torch._dynamo.reset()
        backend = swap_pass.make_swap_backend(inner=way[len("swap_backend["):-1])
        forward = torch.compile(model, backend=backend)
    elif way == "compile_layers":
        close = swap_pass.compile_layers(model, backend="aot_eager").remove
    elif way == "smartswap":
        smart = swap_pass.SmartSwap(model, memory_budget=0.5)
        smart.__enter__()
        close = smart.close
    else:
        raise ValueError(f"swap_pass.tools.bench.windows: unknown way in {way!r}; one of {WAYS}.")

    def step(ids: torch.Tensor, labels: torch.Tensor) -> None:
        forward(ids, labels).backward()
        model.zero_grad(set_to_none=True)
        if smart is not None:
            smart.step()

    return step, close, smart


def _spacing(starts: list[int]) -> float | None:
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False) if b > a]
    return statistics.median(gaps) if gaps else None


def _record_step(step: Callable, batch: tuple[torch.Tensor, torch.Tensor]):
    from swap_pass.testing import accelerator as device_knobs

    device_knobs.record_copy_windows(True)
    try:
        step(*batch)
        torch.accelerator.synchronize()
        return device_knobs.copy_windows()
    finally:
        device_knobs.record_copy_windows(False)


def measure_way(way: str, device: torch.device, *, steps: int = 1,
                unit: tuple[float, float] | None = None) -> WindowRow:
    """Train ``CFG``'s model through ``way`` for ``steps`` warm-up steps (SmartSwap: until its
    plan is stable, at most 8), then record one step's copy windows.

    Args:
        unit: Ops of a layer's forward and backward to count in; None: the way's own copy
            spacing (layer-input mode).
    """
    import swap_pass
    from swap_pass.testing import accelerator as device_knobs

    reason = device_knobs.inductor_reason() if way == "swap_backend[inductor]" else None
    if reason is not None:
        return WindowRow(way, [], [], [], (0.0, 0.0), note=reason)
    swap_pass.reset()
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=way != "apply_swap_pass").to(device)
    step, close, smart = _way(way, model)
    batch = make_batch(CFG, 2, 16, device=device)
    try:
        for _ in range(8 if smart is not None else steps):
            step(*batch)
            if smart is not None and smart.stage == "stable":
                break
        windows = _record_step(step, batch)
    finally:
        close()
        torch._dynamo.reset()
    d2h = [w for w in windows if w.direction == "d2h" and w.closed_by.startswith("stream")]
    h2d = [w for w in windows if w.direction == "h2d" and w.closed_by.startswith("stream")]
    fwd, bwd = unit or (_spacing([w.queued_at_ops for w in d2h]),
                        _spacing([w.queued_at_ops for w in h2d]))
    if not fwd or not bwd:
        return WindowRow(way, [], [], [], (0.0, 0.0), note="fewer than two copies each way")
    restores = {i for i, w in enumerate(h2d) if w.ops == 0}
    return WindowRow(way, [w.ops / fwd for w in d2h], [w.ops / bwd for w in h2d],
                     [w.ops / bwd for i, w in enumerate(h2d) if i not in restores], (fwd, bwd),
                     note=f"{len(restores)} restore(s) waited at once" if restores else "")


def measure_windows(device: torch.device, ways: tuple[str, ...] = WAYS) -> list[WindowRow]:
    """One :class:`WindowRow` per way in (see the module's docstring)."""
    rows, eager_unit = [], None
    for way in ways:
        unit = eager_unit if way == "smartswap" else None
        if way == "smartswap" and unit is None:
            unit = measure_way("enable", device).layer_ops
        row = measure_way(way, device, unit=unit)
        if way == "enable":
            eager_unit = row.layer_ops
        rows.append(row)
    return rows


def format_windows(rows: list[WindowRow]) -> str:
    """The windows table: median and least window of each direction, in layers."""

    def cell(values: list[float]) -> str:
        return "-" if not values else f"{statistics.median(values):.2f} (min {min(values):.2f})"

    lines = ["Copy windows (test accelerator): compute each copy can hide behind, in layers",
             f"{'way in':<24} {'copies out (fwd layers)':>24} {'prefetches (bwd layers)':>24}"
             "  note"]
    for r in rows:
        lines.append(f"{r.way:<24} {cell(r.d2h):>24} {cell(r.prefetches):>24}  {r.note}")
    return "\n".join(lines)
