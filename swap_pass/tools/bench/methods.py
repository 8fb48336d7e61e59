"""The methods ``swap-pass bench`` compares, each built the same way from the same model.

A method is a function ``build(model, ctx) -> Runner``. It imports what it needs inside the
function, so a piece missing from this build (or an optional peer such as torchtune) becomes a
row with its reason (:class:`MethodSkipped`) instead of an import error for the whole bench.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable

import torch
from torch import nn

from swap_pass import SwapConfig
from swap_pass.runtime.device import accelerator_type

__all__ = ["METHODS", "TOOL_KEYS", "BenchContext", "Method", "MethodSkipped", "Runner",
           "default_compile_inner", "require", "torchtune_offloading"]


class MethodSkipped(Exception):
    """A method cannot run here; the message is the reason shown in its row."""


@dataclasses.dataclass
class BenchContext:
    """What every method is built with.

    Args:
        device: Device the model trains on.
        compile_inner: Inner compiler for the compile rows (``"inductor"``, ``"aot_eager"``).
        smart_budget_bytes: SmartSwap's ``memory_budget``; None until the no-swap row has run.
        swap_config: Runtime knobs (e.g. ``max_host_bytes``) of the eager swap and SmartSwap rows;
            None for the defaults. Default: ``None``.
    """

    device: torch.device
    compile_inner: str = "aot_eager"
    smart_budget_bytes: int | None = None
    swap_config: SwapConfig | None = None


@dataclasses.dataclass
class Runner:
    """One method ready to train.

    Attributes:
        forward: ``(input_ids, labels) -> loss`` with the method active.
        after_step: Called after each optimizer step (``SmartSwap.step``). Default: no-op.
        ready: True once warm-up may end (SmartSwap: stage ``"stable"``). Default: always.
        close: Undo the method (remove hooks, leave contexts). Default: no-op.
        pause: Context manager under which another model's step runs untouched by the method
            (SmartSwap's hooks are process-wide). Default: ``contextlib.nullcontext``.
        module: The module that trains when the method builds its own from the bench model
            (HF's offload row); its parameters are the ones the optimizer steps. Default: ``None``
            (the bench model).
    """

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    after_step: Callable[[], None] = lambda: None
    ready: Callable[[], bool] = lambda: True
    close: Callable[[], None] = lambda: None
    pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    module: nn.Module | None = None


@dataclasses.dataclass(frozen=True)
class Method:
    """A row of the bench.

    Attributes:
        key: Short id (JSON key, ``--methods`` value).
        label: Row label.
        build: ``(model, ctx) -> Runner``.
        recompute: Whether the model runs each layer under activation checkpointing.
        reference: Key of the method whose losses this one must reproduce exactly; ``""`` for
            none (no swap itself, and rows that run other model code).
    """

    key: str
    label: str
    build: Callable[[nn.Module, BenchContext], Runner]
    recompute: bool = False
    reference: str = "no_swap"


def require(module: str, name: str) -> object:
    """``module.name``, or :class:`MethodSkipped` saying why it cannot be had."""
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        if top != "swap_pass" and getattr(err, "name", "") and err.name.split(".")[0] == top:
            raise MethodSkipped(f"{top} is not installed (pip install {top}); {module}.{name} "
                                "cannot be imported") from None
        raise MethodSkipped(
            f"{module}.{name} not available in this build ({type(err).__name__})") from None
    if not hasattr(mod, name):
        raise MethodSkipped(f"{module}.{name} not available in this build")
    return getattr(mod, name)


def _plain(model: nn.Module, ctx: BenchContext) -> Runner:
    return Runner(forward=model)


def _eager_swap(model: nn.Module, ctx: BenchContext) -> Runner:
    enable = require("swap_pass", "enable_swap_layer_input")
    handle = enable(model, config=ctx.swap_config)
    return Runner(forward=model, close=handle.remove)


def _compiled(backend: object) -> Callable[[nn.Module], Runner]:
    torch._dynamo.reset()
    return lambda model: Runner(forward=torch.compile(model, backend=backend))


def _compile_plain(model: nn.Module, ctx: BenchContext) -> Runner:
    return _compiled(ctx.compile_inner)(model)


def _compile_swap(model: nn.Module, ctx: BenchContext) -> Runner:
    make_swap_backend = require("swap_pass", "make_swap_backend")
    return _compiled(make_swap_backend(inner=ctx.compile_inner))(model)


def _compile_budget(model: nn.Module, ctx: BenchContext) -> Runner:
    make_swap_backend = require("swap_pass", "make_swap_backend")
    return _compiled(make_swap_backend(inner=ctx.compile_inner, memory_budget=0.5))(model)


def _with_context(model: nn.Module,
                  make_ctx: Callable[[], contextlib.AbstractContextManager]) -> Runner:
    def forward(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with make_ctx():
            return model(input_ids, labels)

    return Runner(forward=forward)


def _save_on_cpu(model: nn.Module, ctx: BenchContext) -> Runner:
    pin = ctx.device.type != "cpu"
    return _with_context(model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin))


def torchtune_offloading(ctx: BenchContext) -> contextlib.AbstractContextManager:
    """torchtune's ``OffloadActivations`` (pinned, with streams), or :class:`MethodSkipped` where
    it cannot run."""
    if ctx.device.type != "cuda":  # checked with torchtune 0.6.1 installed: it fails elsewhere
        # The message names torchtune's own CUDA calls; swap_pass makes none here.
        raise MethodSkipped(
            f"torchtune OffloadActivations is CUDA-only (it takes torch.cuda.default_stream() and "
            f"copies back with .to('cuda')); the device is {ctx.device.type}")
    offload = require("torchtune.training", "OffloadActivations")
    return offload(use_pin_memory=True, use_streams=True)


def _torchtune(model: nn.Module, ctx: BenchContext) -> Runner:
    hooks = torchtune_offloading(ctx)
    return _with_context(model, lambda: hooks)


def _hf_offload(model: nn.Module, ctx: BenchContext) -> Runner:
    from swap_pass.tools.bench.hf_offload import hf_offload

    return hf_offload(model, ctx)


def _smartswap(model: nn.Module, ctx: BenchContext) -> Runner:
    smart_cls = require("swap_pass", "SmartSwap")
    if ctx.smart_budget_bytes is None:
        raise MethodSkipped("SmartSwap's budget is a fraction of the no-swap peak; "
                            "run the no_swap row too")
    smart = smart_cls(model, memory_budget=ctx.smart_budget_bytes, config=ctx.swap_config)
    smart.__enter__()

    @contextlib.contextmanager
    def pause():  # between steps: its hooks off, then on again for the next step
        smart.close()
        try:
            yield
        finally:
            smart.__enter__()

    return Runner(forward=model, after_step=smart.step, ready=lambda: smart.stage == "stable",
                  close=lambda: smart.__exit__(None, None, None), pause=pause)


METHODS: list[Method] = [
    Method("no_swap", "no swap", _plain, reference=""),
    Method("recompute", "full recompute", _plain, recompute=True),
    Method("eager_swap", "recompute + swap (eager)", _eager_swap, recompute=True),
    Method("compile", "recompute, compiled (no swap)", _compile_plain, recompute=True),
    Method("compile_swap", "recompute + swap (compile)", _compile_swap, recompute=True,
           reference="compile"),
    Method("compile_plain", "compiled (no swap)", _compile_plain),
    Method("compile_budget", "swap @ budget 0.5 (compile)", _compile_budget,
           reference="compile_plain"),
    Method("save_on_cpu", "torch save_on_cpu", _save_on_cpu),
    Method("smartswap", "SmartSwap @ budget", _smartswap),
    Method("torchtune", "torchtune OffloadActivations", _torchtune),
    Method("hf_offload", "HF checkpointing + offload", _hf_offload, reference=""),
]


def _offload_tool(key: str) -> Callable[[nn.Module, BenchContext], Runner]:
    def build(model: nn.Module, ctx: BenchContext) -> Runner:
        from swap_pass.tools.bench.offload_tools import BUILDS

        return BUILDS[key](model, ctx)

    return build


# Fine-tuning tools' offloading, each against HF checkpointing of the same model
# (swap_pass/tools/bench/offload_tools.py); HF checkpointing itself is not compared (HF's kernels
# are not the bench model's: the same losses on CPU, not on every device).
TOOL_KEYS = ("hf_recompute", "trl_offload", "trl_offload_all", "trl_swap", "torchtune_offload",
             "torchtune_swap", "accelerate_offload", "accelerate_swap")
METHODS += [Method(key, label, _offload_tool(key), recompute=True,
                   reference="" if key == "hf_recompute" else "hf_recompute")
            for key, label in zip(TOOL_KEYS, (
                "HF checkpointing", "TRL offload + checkpointing", "TRL offload, no checkpointing",
                "TRL flag served by swap_pass", "torchtune offload + checkpointing",
                "torchtune flag served by swap_pass", "accelerate AC offload",
                "accelerate AC offload served by swap_pass"), strict=True)]


def default_compile_inner() -> str:
    """``"inductor"`` on an accelerator; ``"aot_eager"`` on CPU, where inductor's C++ build is
    slow."""
    return "inductor" if accelerator_type() != "cpu" else "aot_eager"
