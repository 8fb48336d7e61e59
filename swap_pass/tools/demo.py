"""``swap-pass demo``: train a small Llama-style model with and without swap, print a table.

Rows: no swap; full recompute (each layer keeps only its input); recompute + swap (those inputs
go to host memory). Same weights, seed and data; losses compared with ``torch.equal``.
"""

from __future__ import annotations

import sys

import torch

from swap_pass.tools.bench.harness import MethodResult
from swap_pass.tools.bench.methods import BenchContext, default_compile_inner
from swap_pass.tools.bench.presets import BenchPreset
from swap_pass.tools.bench.report import format_rows, mib, ms
from swap_pass.tools.bench.run import BenchReport, load_caveat, run_bench
from swap_pass.tools.models import LlamaConfig

__all__ = ["DEMO_METHODS", "DEMO_PRESET", "demo_preset", "format_demo", "run_demo"]

DEMO_METHODS = ("no_swap", "recompute", "eager_swap")
DEFAULT_STEPS = 5  # per row: 1 warm-up, 3 timed (each with its paired no-swap step), 1 profiled

# No compile rows here, so the demo affords 16 layers (the bench's tiny preset has 6): the 15
# layer inputs swap frees are then about a third of the full-recompute peak. Seq 256 (not 512)
# halves every step and leaves the peaks' ratios as they were.
DEMO_PRESET = BenchPreset(
    name="demo",
    model=LlamaConfig(vocab_size=256, hidden_size=64, num_layers=16, num_heads=4,
                      intermediate_size=176, max_seq_len=1024),
    batch=4, seq=256, dtype="fp32", warmup_steps=1, timed_steps=1,
    note="swap-pass demo: 16 layers, hidden 64, seq 256",
)


def demo_preset(*, hidden: int | None = None, layers: int | None = None, seq: int | None = None,
                batch: int | None = None, steps: int | None = None) -> BenchPreset:
    """:data:`DEMO_PRESET` with the sizes given (None keeps its value).

    ``steps`` counts every step of a row: one warm-up, ``steps - 2`` timed, one profiled.
    Default: ``DEFAULT_STEPS``.
    """
    preset = DEMO_PRESET
    changes = {"hidden_size": hidden, "num_layers": layers, "seq": seq, "batch": batch}
    changes = {k: v for k, v in changes.items() if v is not None}
    if seq is not None:
        changes["max_seq_len"] = max(seq, preset.model.max_seq_len)
    steps = DEFAULT_STEPS if steps is None else steps
    changes.update(warmup_steps=1, timed_steps=max(steps - 2, 1))
    return preset.resized(**changes)

def _cells(r: MethodResult) -> list[str]:
    match = "(reference)" if r.losses_match is None else ("yes (bitwise)" if r.losses_match
                                                         else f"NO ({r.max_loss_diff:.1e})")
    return [r.label, mib(r.peak_bytes),
            mib(r.peak_device_bytes_released) if r.peak_device_bytes_released else "-",
            ms(r.step_s), ms(r.cpu_s), match]

_CPU_TIMES = ("on CPU the copies are synchronous: the time columns show what the copies cost, "
              "not whether they overlap compute (that needs an accelerator's streams); which of "
              "full recompute and recompute + swap is faster can flip from run to run")


def format_demo(report: BenchReport, preset: BenchPreset, device: torch.device) -> str:
    """The demo's table, what its columns mean on this device, and the load caveat if any."""
    rows, caveat = report.rows, load_caveat(report.meta, report.rows)
    mem = ("peak MiB = bytes the CPU allocator held above the step's start (torch.profiler memory "
           "events; CPU has no separate device memory)") if device.type == "cpu" else \
        "peak MiB = torch.accelerator.max_memory_allocated above the step's start"
    head = ["", "peak MiB", "freed by swap MiB", "step ms", "CPU ms", "losses match no swap"]
    m = preset.model
    return "\n".join([
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, batch {preset.batch}, "
        f"seq {preset.seq}, "
        f"{preset.dtype}, on {device}, {report.meta.get('threads', '?')} intra-op thread(s)",
        format_rows(rows, head, _cells),
        mem,
        "freed by swap MiB = the runtime's figure (swap_stats().peak_device_bytes_released): layer "
        "inputs whose storage was freed because their data was on the host",
        f"step ms / CPU ms = median wall / process CPU time of {preset.timed_steps} timed "
        "step(s)",
        *([_CPU_TIMES] if device.type == "cpu" else []),
        *([caveat] if caveat else []),
    ])

def run_demo(preset: BenchPreset, device: torch.device, seed: int = 0, progress: bool = True,
             threads: int | None = 1) -> BenchReport:
    """Train the demo's three rows; return the report (``report.rows`` holds them).

    Args:
        threads: Intra-op threads while training (None: as set). Default: ``1``.
    """
    steps_per_method = preset.warmup_steps + preset.timed_steps + 1
    bar = _progress_bar(steps_per_method * len(DEMO_METHODS), progress)
    ctx = BenchContext(device, default_compile_inner())
    report = run_bench(preset, ctx, methods=DEMO_METHODS, seed=seed, smart_rows=False,
                       host_rows=False, threads=threads,
                       progress=lambda label: bar.set_description(label), on_step=bar.update)
    bar.close()
    return report

class _NoBar:
    """Stand-in when tqdm is not installed (it comes with the ``test`` extra)."""

    def update(self, n: int = 1) -> None:
        return None

    def set_description(self, text: str) -> None:
        print(f"... {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        return None


def _progress_bar(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="step", disable=not enabled, file=sys.stderr, leave=False)
