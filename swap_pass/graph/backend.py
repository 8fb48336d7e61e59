"""``swap_backend``: a Dynamo backend on AOTAutograd that swaps saved layer inputs to host memory.

Pipeline::

    Dynamo graph --AOTAutograd--> joint graph --partitioner--> forward + backward graphs
                                                   |
                        swap_saved_layer_inputs (aot_pass.py): swap_out/wait in the forward,
                        prefetch/wait (or swap_in) in the backward, for each saved layer input
                                                   |
                                    inner compiler: Inductor, aot_eager, callable

The partitioner is the inner compiler's own (Inductor's pipeline through a custom partitioner
hook; ``min_cut_rematerialization_partition`` for the others), so the graphs differ from a compile
without swap only by the swap nodes. Checkpointed layers save just their input: what is swapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from swap_pass.config import SwapConfig, check_config
from swap_pass.graph.aot_pass import SwappedTensor, swap_saved_layer_inputs, swap_within_budget
from swap_pass.graph.boundaries import LayerFilter, with_module_filter
from swap_pass.graph.budget import Budget, CostModel
from swap_pass.graph.module_names import name_modules_as_the_model_does
from swap_pass.graph.sac_tags import take_offload_tags
from swap_pass.opt_out import ModuleFilter, check_module_filter

__all__ = ["Partition", "make_swap_backend", "swap_backend"]

_INNER_NAMES = ("inductor", "aot_eager")
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Partition:
    """One forward/backward pair the backend rewrote (kept for inspection and docs).

    Attributes:
        forward, backward: The rewritten graphs.
        swapped: What moved to host memory, in forward order.
        mode: ``"layer_input"`` or ``"budget"``.
        predicted_peak_without_swap, predicted_peak: Budget mode: the peak of the bytes the
            graphs make, as the cost model predicts it, before and after the choice (else 0).
        budget_bytes: Budget mode: the target peak in bytes (else ``None``).
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    swapped: list[SwappedTensor]
    mode: str = "layer_input"
    predicted_peak_without_swap: int = 0
    predicted_peak: int = 0
    budget_bytes: int | None = None

    def summary(self) -> str:
        """One line per swapped tensor, after a line on the mode and the predicted peak."""
        moved = sum(s.nbytes for s in self.swapped)
        head = f"{self.mode}: {len(self.swapped)} saved tensors swapped, {moved} bytes"
        if self.mode == "budget":
            head += (f"; predicted peak {self.predicted_peak_without_swap} -> {self.predicted_peak}"
                     f" bytes (budget {self.budget_bytes})")
        return "\n".join([head, *(
            f"  {s.name} ({s.layer or 'outside any module'}): {s.nbytes} bytes"
            for s in self.swapped)])


@dataclasses.dataclass
class _Swapped:
    """What a backend swapped so far: whether a graph swapping nothing is worth a warning."""

    graphs: int = 0
    swapped_graphs: int = 0


def _report_nothing_swapped(fw: fx.GraphModule, n_out: int, layer_filter: LayerFilter,
                            seen: _Swapped, where: str) -> None:
    """Count and warn once (per backend) about a graph that swaps nothing, while no graph of this
    backend swapped anything; later graphs without layers (the loss after a break) only log."""
    from swap_pass.graph.aot_pass import why_nothing_swapped
    from swap_pass.runtime.stats import SkipReason, record_skip
    from swap_pass.state import warn_once

    reason, nbytes = why_nothing_swapped(fw, n_out, layer_filter)
    record_skip(SkipReason.NO_LAYERS, nbytes, where=where, warn=False)
    if seen.swapped_graphs:
        _log.debug("swap_pass.swap_backend: a graph swaps nothing: %s", reason)
        return
    warn_once(SkipReason.NO_LAYERS.value, where,
              f"swap_pass.swap_backend: a compiled graph swaps nothing ({nbytes} bytes saved for "
              f"backward stay on the device; {seen.graphs} graph(s) compiled by this backend, none "
              f"swapped anything): {reason}. (Shown once per backend until swap_pass.reset().)")


def _swap_partition(base: Callable, layer_filter: LayerFilter, config: SwapConfig,
                    record: list[Partition], budget: Budget | None, cost: CostModel,
                    where: str) -> Callable:
    """Wrap partitioner ``base`` so that its forward/backward pair gets the swap nodes."""
    seen = _Swapped()

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        tags = take_offload_tags(joint)  # Note: [Offload tags in compiled graphs] in sac_tags.py
        fw, bw = base(joint, joint_inputs, **kwargs)
        n_out = kwargs["num_fwd_outputs"]
        seen.graphs += 1
        if budget is None:
            swapped = swap_saved_layer_inputs(fw, bw, n_out, layer_filter=layer_filter,
                                              config=config, offload_tags=tags)
            record.append(Partition(fw, bw, swapped))
            if not swapped:
                _report_nothing_swapped(fw, n_out, layer_filter, seen, where)
            seen.swapped_graphs += bool(swapped)
            return fw, bw
        swapped, before, after = swap_within_budget(fw, bw, n_out, budget=budget, cost=cost,
                                                    config=config, offload_tags=tags)
        seen.swapped_graphs += bool(swapped)
        record.append(Partition(fw, bw, swapped, "budget", before, after, budget.bytes_for(before)))
        if after > budget.bytes_for(before):
            warnings.warn(f"swap_pass.swap_backend: memory_budget={budget.value!r} not reached: "
                          f"predicted peak {before} -> {after} bytes, no saved tensor left whose "
                          "copies hide behind compute.", stacklevel=2)
        return fw, bw

    return partition


def _min_cut(joint, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


# --- inner compilers --------------------------------------------------------------------------


def _partitioner_uuid(*keys: object) -> str:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    from swap_pass.graph import aot_pass, boundaries, budget, ops, sac_tags

    files = tuple(m.__file__ for m in (aot_pass, boundaries, budget, ops, sac_tags))
    return ":".join([get_hash_for_files(files).hex(), *map(repr, keys)])


def _make_partitioner(partition: Callable, uuid: str):
    """An Inductor ``CustomPartitionerFn`` running ``partition``; pickles as its uuid (cache)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class SwapPartitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> Any:
            return uuid

        def __reduce__(self):
            return (str, (uuid,))

    return SwapPartitioner()


@contextlib.contextmanager
def _inductor_partitioner(partition: Callable, uuid: str):
    """Make Inductor's own pipeline (joint passes included) partition with ``partition``."""
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config, "custom_partitioner_fn"):
        with inductor_config.patch(custom_partitioner_fn=_make_partitioner(partition, uuid)):
            yield
        return
    # older torch: Inductor calls the module-level min-cut partitioner by name
    original = cfx.min_cut_rematerialization_partition
    cfx.min_cut_rematerialization_partition = functools.partial(
        lambda base, *a, **k: partition(*a, **k), original)
    try:
        yield
    finally:
        cfx.min_cut_rematerialization_partition = original


def _compile_inductor(gm, example_inputs, partition: Callable, uuid: str,
                      patches: dict[str, Any]):
    from torch._inductor.compile_fx import compile_fx

    with _inductor_partitioner(partition, uuid):
        return compile_fx(gm, example_inputs, config_patches=patches)


# Note: [Whole-model CUDA graphs]
# ``torch.compile(model, backend=swap_backend, mode="reduce-overhead")`` (or "max-autotune",
# ``options={"triton.cudagraphs": True}``, ``torch._inductor.config.triton.cudagraphs = True``)
# asks the inner Inductor for CUDA graphs. A replay reuses the capture's host buffers and device
# blocks: a prefetch would write a block the replay no longer owns, a copy out would read a layer
# input the trees' private pool has handed on, and the host pool, events and frees are host-side
# bookkeeping a replay skips. The ops' ``cudagraph_unsafe`` tag only splits graphs Inductor
# partitions. So the backend refuses CUDA graphs on an accelerator at the first graph, before any
# step, naming the modes that swap; on the CPU, which captures nothing, the other options apply.


def _inductor_patches(inner: str | Callable, mode: str | None, options: dict | None,
                      example_inputs) -> dict[str, Any]:
    """The Inductor options ``torch.compile(mode=, options=)`` passed to the backend.

    Raises:
        ValueError: ``mode``/``options`` with an inner compiler other than Inductor, or CUDA
            graphs asked for a graph on an accelerator (Note: [Whole-model CUDA graphs]).
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    if inner != "inductor":
        if mode or options:
            raise ValueError(
                f"swap_pass.swap_backend: torch.compile(mode={mode!r}, options={options!r}) "
                f"configures Inductor, but this backend compiles with inner={inner!r}. Pass "
                "them only with make_swap_backend(inner='inductor').")
        return {}
    patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    cuda_graphs = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    if cuda_graphs and devices - {"cpu"}:
        asked = (f"mode={mode!r}" if mode else "options={'triton.cudagraphs': True}"
                 if (options or {}).get("triton.cudagraphs") else
                 "torch._inductor.config.triton.cudagraphs=True")
        raise ValueError(
            f"swap_pass.swap_backend: {asked} asks Inductor to capture CUDA graphs, which cannot "
            "run the swap ops (a replay reuses the capture's host buffers and device blocks). "
            "Compile with mode='default' or mode='max-autotune-no-cudagraphs' to swap, or keep "
            "CUDA graphs without swapping: swap_pass.compile_layers(model, swap=False, "
            f"mode={mode or 'reduce-overhead'!r}).")
    return patches


def _compile_aot(gm, example_inputs, partition: Callable, fw: Callable, bw: Callable, **kwargs):
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=partition,
                        keep_inference_input_mutations=True, **kwargs)(gm, example_inputs)


def _boxed(compiler: Callable) -> Callable:
    """``compiler`` with its result boxed, unless it is already (AOTAutograd accepts both)."""

    def boxed(gm: fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func

        compiled = compiler(gm, example_inputs)
        return compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)

    return boxed


def _refuse_npu() -> None:
    """``inner="npu"``: torchair cannot compile the rewritten graphs; say where NPUs are served."""
    raise ValueError(
        "swap_pass.make_swap_backend: inner='npu' is not supported. torchair compiles whole "
        "Dynamo graphs with its own decompositions and partitioner, its GE graphs have no "
        "converters for swap_pass::* ops, and host-side stream bookkeeping cannot run inside a "
        "GE graph or a captured aclgraph. Compile each layer with torchair and swap between "
        "layers instead: swap_pass.compile_layers(model, backend='npu')."
    )


def _compiled_autograd_on() -> bool:
    from torch._dynamo import compiled_autograd
    from torch._dynamo import config as dynamo_config

    return bool(getattr(dynamo_config, "compiled_autograd", False)
                or getattr(compiled_autograd, "compiled_autograd_enabled", False))


def _refuse_compiled_autograd() -> None:
    """Note: [Compiled autograd]
    Compiled autograd retraces the backward graphs through AOTAutograd, which refuses custom ops
    whose output aliases an input (``swap_pass::wait`` is ``Tensor(a) -> Tensor(a)``, to hand back
    what it waited for without a copy), and would order the swap ops as the backward's compiler
    chooses, not as this pass planned. So the backend refuses to compile, before any step runs,
    instead of failing inside the first backward.
    """
    if _compiled_autograd_on():
        raise RuntimeError(
            "swap_pass.swap_backend: compiled autograd is on (torch._dynamo.config."
            "compiled_autograd=True or compiled_autograd.enable()), which does not run the swap "
            "ops of the backward graph (swap_pass::wait aliases its input). Compiled autograd "
            "must be off while this backend compiles and trains the model.")


def _check_inner(inner: object) -> None:
    if inner == "npu":
        _refuse_npu()
    if callable(inner) or inner in _INNER_NAMES:
        return
    raise ValueError(
        f"swap_pass.make_swap_backend: inner={inner!r} is not a known compiler. It must be one "
        f"of {list(_INNER_NAMES)} or a callable (gm, example_inputs) -> callable."
    )


# --- the backend ------------------------------------------------------------------------------


def make_swap_backend(inner: str | Callable = "inductor", *, layer_filter: LayerFilter = None,
                      config: SwapConfig | None = None, memory_budget: int | float | None = None,
                      cost_model: CostModel | None = None,
                      module_filter_fn: ModuleFilter = None) -> Callable:
    """Build a Dynamo backend that swaps tensors saved for backward to host memory.

    Layer-input mode (the default) moves the saved input of every layer but the last; budget
    mode (``memory_budget``) moves any saved tensors, chosen so that the predicted peak fits the
    budget and every copy hides behind compute (see :mod:`swap_pass.graph.budget`).

    Args:
        inner: The compiler the rewritten graphs go to: ``"inductor"``, ``"aot_eager"``, or a
            callable ``(gm, example_inputs) -> callable`` for forward and backward, returning a
            plain or a boxed (``make_boxed_func``) function. Default: ``"inductor"``.
        layer_filter: Which modules are the layers; see :func:`find_layer_boundaries`.
            Default: ``None`` (guess).
        config: Runtime knobs: ``max_host_bytes``, ``prefetch``, ``use_streams``,
            ``pin_memory``, ``min_swap_bytes``. Default: ``SwapConfig()``.
        memory_budget: Budget mode: the target peak of the bytes a compiled graph makes
            (activations, temporaries, gradients; not its inputs), as an int number of bytes
            or a float fraction in (0, 1] of the predicted peak without swap. ``None`` keeps
            layer-input mode. Default: ``None``.
        cost_model: Budget mode: copy bandwidth and FLOP rate; what it leaves ``None`` is
            measured on the graph's device. Default: ``CostModel()``.
        module_filter_fn: Layer-input mode: ``(module, fqn) -> bool``; layers it returns False
            for keep their input. Compiled graphs keep only module names, so ``module`` is
            ``None``: filter on ``fqn``. Default: ``None`` (all layers).

    Returns:
        A backend for ``torch.compile(model, backend=...)``; its ``partitions`` attribute holds
        the last rewritten forward/backward pairs (:class:`Partition`). ``torch.compile``'s
        ``mode=`` and ``options=`` reach the inner Inductor; CUDA graphs on an accelerator raise
        ``ValueError`` at the first compile (Note: [Whole-model CUDA graphs]).

    Raises:
        ValueError: ``inner`` is unknown or ``"npu"`` (use :func:`swap_pass.compile_layers`
            with ``backend="npu"``), or ``memory_budget`` is invalid.
    """
    import collections

    _check_inner(inner)
    config = check_config(config, "make_swap_backend")
    check_module_filter(module_filter_fn, "make_swap_backend")
    layer_filter = with_module_filter(layer_filter, module_filter_fn)
    record: collections.deque[Partition] = collections.deque(maxlen=16)
    budget = None if memory_budget is None else Budget(memory_budget)
    cost = cost_model or CostModel()
    name = f"swap_backend_{inner if isinstance(inner, str) else 'custom'}"
    partition = _swap_partition(_min_cut, layer_filter, config, record, budget, cost,
                                f"{name}@{id(record):x}")

    def backend(gm: fx.GraphModule, example_inputs, *, mode: str | None = None,
                options: dict | None = None):
        _refuse_compiled_autograd()
        patches = _inductor_patches(inner, mode, options, example_inputs)
        name_modules_as_the_model_does(gm)  # Note: [Module names in resumed frames]
        if inner == "inductor":
            return _compile_inductor(gm, example_inputs, partition,
                                     _partitioner_uuid(layer_filter, config, budget, cost),
                                     patches)
        if inner == "aot_eager":
            from torch._dynamo.backends.debugging import boxed_nop

            return _compile_aot(gm, example_inputs, partition, boxed_nop, boxed_nop)
        compiler = _boxed(inner)
        return _compile_aot(gm, example_inputs, partition, compiler, compiler)

    backend.partitions = record
    backend.inner = inner
    backend.__name__ = name
    return backend


swap_backend = make_swap_backend()
swap_backend.__doc__ = "The default swap backend: ``make_swap_backend(inner='inductor')``."
