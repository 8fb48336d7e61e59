"""Run each bench method on the same model, seed and data, and measure it the same way.

Per method: a fresh model from the same seed; ``warmup_steps`` untimed steps (more while the
method says it is not ready, e.g. SmartSwap before its ``"stable"`` stage); ``timed_steps`` timed
steps; one profiled step for memory and copies (see :mod:`swap_pass.tools.bench.measure`). Losses of
every step are kept and compared with ``torch.equal`` to the method's reference (no swap, or the
same compile without swap).

Note: [Paired timing]
On a shared machine the speed of a step moves with other work by several times within a
minute. Each timed step of a method is therefore followed by one step of a plain no-swap model
of the same size (the pace setter, shared by all rows, with the method paused); the method's
time ratio is the median over its steps of (its wall time / the pace setter's right after), and
its CPU ratio the same in process CPU time (all threads), which other processes on the cores
move far less. Load that comes and goes hits both halves of a pair alike. Wall and CPU time are
kept for every step, device synchronized.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import ContextManager

import torch
from torch import nn
from torch.profiler import record_function

import swap_pass
from swap_pass.tools.bench.measure import (
    BACKWARD_RANGE,
    FORWARD_RANGE,
    StepProfile,
    profile_step,
    synchronize,
)
from swap_pass.tools.bench.methods import BenchContext, Method, MethodSkipped, Runner
from swap_pass.tools.bench.presets import BenchPreset
from swap_pass.tools.models import LlamaStyleModel, make_batch

__all__ = ["MAX_EXTRA_WARMUP", "MethodResult", "build_model", "pace_setter", "run_method"]

MAX_EXTRA_WARMUP = 20


@dataclasses.dataclass
class MethodResult:
    """One row of the bench: what was measured, or why nothing was."""

    key: str
    label: str
    status: str  # "ok", "skipped" or "failed"
    reason: str = ""
    reference: str = ""
    steps: int = 0
    step_s: float | None = None
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: float | None = None
    cpu_times_s: list[float] = dataclasses.field(default_factory=list)
    pace_times_s: list[float] = dataclasses.field(default_factory=list)
    pace_cpu_times_s: list[float] = dataclasses.field(default_factory=list)
    paired_ratios: list[float] = dataclasses.field(default_factory=list)
    paired_cpu_ratios: list[float] = dataclasses.field(default_factory=list)
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    peak_source: str = ""
    losses: list[float] = dataclasses.field(default_factory=list)
    losses_match: bool | None = None
    max_loss_diff: float | None = None
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    peak_host_bytes: int = 0
    peak_device_bytes_released: int = 0
    d2h_gbs: float | None = None
    h2d_gbs: float | None = None
    memory_ratio: float | None = None
    time_ratio: float | None = None
    time_vs_recompute: float | None = None
    cpu_ratio: float | None = None
    tokens_ratio: float | None = None
    curve_ms: list[float] = dataclasses.field(default_factory=list, repr=False)
    curve_bytes: list[int] = dataclasses.field(default_factory=list, repr=False)
    loss_tensors: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        """The row as JSON-ready data (loss tensors left out)."""
        out = dataclasses.asdict(self)
        out.pop("loss_tensors")
        return out


def build_model(preset: BenchPreset, recompute: bool, device: torch.device, seed: int) -> nn.Module:
    """The preset's model, weights from ``seed``, on ``device`` in the preset's dtype."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it trains: no host-side init of big presets
        model = LlamaStyleModel(preset.model, recompute=recompute)
    return model.to(dtype=preset.torch_dtype)


def _train_step(runner: Runner, opt: torch.optim.Optimizer,
                batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with record_function(FORWARD_RANGE):
        loss = runner.forward(*batch)
    with record_function(BACKWARD_RANGE):
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients stay allocated: the step's peak is activations
    runner.after_step()
    return loss.detach()


class _Trainer:
    """Steps one method's model through warm-up, timing and the profiled step."""

    def __init__(self, runner: Runner, model: nn.Module, preset: BenchPreset,
                 device: torch.device, seed: int, on_step: Callable[[], None] | None) -> None:
        self.runner, self.preset, self.device, self.seed = runner, preset, device, seed
        self.on_step = on_step
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        self.losses: list[torch.Tensor] = []

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's data, already on the device (its copy is not part of any step)."""
        return make_batch(self.preset.model, self.preset.batch, self.preset.seq,
                          seed=self.seed + len(self.losses), device=self.device)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        batch = self.next_batch() if batch is None else batch
        self.losses.append(_train_step(self.runner, self.opt, batch))
        if self.on_step is not None:
            self.on_step()

    def warm_up(self) -> None:
        for _ in range(self.preset.warmup_steps):
            self.step()
        extra = 0
        while not self.runner.ready() and extra < MAX_EXTRA_WARMUP:
            self.step()
            extra += 1

    def timed_step(self) -> tuple[float, float]:
        """One step; its wall and process CPU seconds (data made before the clocks start)."""
        batch = self.next_batch()
        synchronize(self.device)
        t, c = time.perf_counter(), time.process_time()
        self.step(batch)
        synchronize(self.device)
        return time.perf_counter() - t, time.process_time() - c

    def timed(self, pace: _Trainer | None, pause: Callable[[], ContextManager]) -> _Times:
        """``timed_steps`` steps, each followed by one of ``pace`` (Note: [Paired timing])."""
        out = _Times()
        for _ in range(self.preset.timed_steps):
            wall, cpu = self.timed_step()
            out.wall.append(wall)
            out.cpu.append(cpu)
            if pace is not None:
                with pause():
                    pace_wall, pace_cpu = pace.timed_step()
                out.pace.append(pace_wall)
                out.pace_cpu.append(pace_cpu)
        return out


@dataclasses.dataclass
class _Times:
    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    pace: list[float] = dataclasses.field(default_factory=list)
    pace_cpu: list[float] = dataclasses.field(default_factory=list)


def pace_setter(preset: BenchPreset, device: torch.device, seed: int) -> _Trainer:
    """The plain no-swap model every timed step is paired with (Note: [Paired timing])."""
    model = build_model(preset, False, device, seed)
    return _Trainer(Runner(forward=model), model, preset, device, seed, None)


def _fill(result: MethodResult, trainer: _Trainer, times: _Times, prof: StepProfile,
          moved: tuple[int, int]) -> None:
    stats = swap_pass.swap_stats()
    result.status, result.steps = "ok", len(trainer.losses)
    result.step_s, result.step_times_s = statistics.median(times.wall), times.wall
    result.cpu_s, result.cpu_times_s = statistics.median(times.cpu), times.cpu
    result.pace_times_s, result.pace_cpu_times_s = times.pace, times.pace_cpu
    # times.pace is empty when there is no pace setter: no paired ratios then.
    result.paired_ratios = [w / p for w, p in zip(times.wall, times.pace, strict=False)]
    result.paired_cpu_ratios = [c / p for c, p in zip(times.cpu, times.pace_cpu, strict=False)
                                if p > 0]
    result.tokens_per_s = trainer.preset.tokens_per_step / result.step_s
    result.peak_bytes, result.peak_source = prof.peak_bytes, prof.peak_source
    result.curve_ms, result.curve_bytes = prof.curve_ms, prof.curve_bytes
    result.loss_tensors = [loss.float().cpu() for loss in trainer.losses]
    result.losses = [float(loss) for loss in result.loss_tensors]
    result.swapped_out_bytes, result.swapped_in_bytes = moved
    result.peak_host_bytes = stats.peak_host_bytes_in_use
    result.peak_device_bytes_released = stats.peak_device_bytes_released
    result.d2h_gbs, result.h2d_gbs = prof.d2h.gbs, prof.h2d.gbs


def _measure(result: MethodResult, runner: Runner, model: nn.Module, preset: BenchPreset,
             device: torch.device, seed: int, on_step: Callable[[], None] | None,
             pace: _Trainer | None) -> None:
    trainer = _Trainer(runner, model if runner.module is None else runner.module, preset, device,
                       seed, on_step)
    trainer.warm_up()
    times = trainer.timed(pace, runner.pause)
    before = swap_pass.swap_stats()
    batch = trainer.next_batch()
    prof = profile_step(device, lambda: trainer.step(batch))
    after = swap_pass.swap_stats()
    moved = (after.swapped_out_bytes - before.swapped_out_bytes,
             after.swapped_in_bytes - before.swapped_in_bytes)
    _fill(result, trainer, times, prof, moved)


def run_method(method: Method, preset: BenchPreset, ctx: BenchContext, seed: int = 0,
               on_error: Callable[[BaseException], None] | None = None,
               on_step: Callable[[], None] | None = None,
               pace: _Trainer | None = None) -> MethodResult:
    """Build, train and measure one method; a row that says why when it cannot run.

    Args:
        on_step: Called after every training step (progress bars). Default: ``None``.
        on_error: Called with an unexpected exception (e.g. to re-raise in tests); the row
            says ``"failed"`` when it returns. Default: ``None``.
        pace: The no-swap model each timed step is paired with (:func:`pace_setter`); None for
            unpaired timing. Default: ``None``.
    """
    result = MethodResult(method.key, method.label, "failed", reference=method.reference)
    swap_pass.reset()
    model = build_model(preset, method.recompute, ctx.device, seed)
    runner = None
    try:
        runner = method.build(model, ctx)
        _measure(result, runner, model, preset, ctx.device, seed, on_step, pace)
    except MethodSkipped as why:
        result.status, result.reason = "skipped", str(why)
    except Exception as err:  # one method failing must not hide the others' rows
        result.reason = f"{type(err).__name__}: {err}"
        if on_error is not None:
            on_error(err)
    finally:
        if runner is not None:
            runner.close()
        swap_pass.reset()
    return result
