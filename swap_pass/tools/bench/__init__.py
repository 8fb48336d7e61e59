"""``swap-pass bench``: methods side by side on one model, seed and data.

Rows: no swap; full recompute; recompute + swap (eager); compile without and with swap;
``torch.autograd.graph.save_on_cpu``; SmartSwap at a budget; torchtune's OffloadActivations;
Hugging Face's checkpointing with offload on the same model
(:mod:`swap_pass.tools.bench.hf_offload`).
A method whose code is not in this build, or whose peer library is not installed, is a row
with its reason. See ``docs/usage.md`` ("Measuring") for what each column means.
"""

from swap_pass.tools.bench.harness import MethodResult, build_model, run_method
from swap_pass.tools.bench.methods import (
    METHODS,
    BenchContext,
    Method,
    MethodSkipped,
    Runner,
    default_compile_inner,
)
from swap_pass.tools.bench.presets import PRESETS, BenchPreset, get_preset
from swap_pass.tools.bench.report import format_report, format_rows, plot_memory, write_json
from swap_pass.tools.bench.run import BenchReport, run_bench

__all__ = [
    "METHODS",
    "PRESETS",
    "BenchContext",
    "BenchPreset",
    "BenchReport",
    "Method",
    "MethodResult",
    "MethodSkipped",
    "Runner",
    "build_model",
    "default_compile_inner",
    "format_report",
    "format_rows",
    "get_preset",
    "plot_memory",
    "run_bench",
    "run_method",
    "write_json",
]
