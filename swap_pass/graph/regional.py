"""``compile_layers``: compile each Transformer layer on its own, swap between layers eagerly.

Regional compile (as torchtitan and torchtune do it) with swap on the shared runtime::

    layer.forward = torch.compile(layer.forward, backend=...)   # one compiled region per layer
    enable_swap_layer_input(model, layers=...)                  # eager protocol around each region

The swap protocol runs outside every compiled region, as in eager mode, so nothing host-side
(streams, events, the host pool) sits inside a graph: the way for backends that cannot hold the
``swap_pass::*`` ops, such as torchair's GE graphs on Ascend NPUs (``backend="npu"``). CUDA graphs
are refused on an accelerator (Note: [No CUDA graphs with swap]). Layers of one class share their
compiled code (Dynamo inlines ``nn.Module`` and guards on parameter metadata, not identity).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from swap_pass.config import SwapConfig, check_config
from swap_pass.eager.enable import (
    SwapLayerInputHandle,
    enable_swap_layer_input,
    find_layer_blocks,
    refuse_module_compile,
)
from swap_pass.handles import SwapHandle
from swap_pass.opt_out import ModuleFilter
from swap_pass.state import warn_once

__all__ = ["CompiledLayers", "compile_layers"]

_API = "compile_layers"
_ATTR = "_swap_pass_compiled_layers"
_MISSING = object()


def npu_backend() -> Callable:
    """torchair's Dynamo backend (``torchair.get_npu_backend``) with its default ``CompilerConfig``.

    Raises:
        RuntimeError: ``torch_npu`` or ``torchair`` does not import here.
    """
    try:
        import torch_npu  # noqa: F401  (registers the NPU device)
        import torchair
    except ImportError as err:
        raise RuntimeError(
            f"swap_pass.{_API}: backend='npu' needs torch_npu and torchair, which do not import "
            f"here ({err}). Install them on an Ascend machine, or use backend='inductor' or "
            "'aot_eager'."
        ) from err
    if not hasattr(torchair, "get_npu_backend"):
        version = getattr(torchair, "__version__", "?")
        raise RuntimeError(f"swap_pass.{_API}: this torchair ({version}) "
                           "has no get_npu_backend. torchair >= 2.1 is needed.")
    return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())


class CompiledLayers(SwapHandle):
    """What :func:`compile_layers` changed; ``remove()`` restores the layers' own ``forward``
    (see :class:`swap_pass.handles.SwapHandle`).

    Attributes:
        model: The model.
        layers: The compiled layers, in call order.
        swap: The eager swap handle around them (``None`` with ``swap=False``).
    """

    def __init__(self, model: nn.Module, layers: list[nn.Module], swap: SwapLayerInputHandle | None,
                 saved: list[Any]) -> None:
        self.model, self.layers, self.swap, self._saved = model, layers, swap, saved
        object.__setattr__(model, _ATTR, self)

    @property
    def active(self) -> bool:
        """True until :meth:`remove` ran."""
        return self.model.__dict__.get(_ATTR) is self

    def _remove(self) -> None:
        """Undo the swap protocol, then the compiled ``forward`` of every layer."""
        if self.swap is not None:
            self.swap.remove()
        for layer, saved in zip(self.layers, self._saved, strict=True):
            del layer.__dict__["forward"]
            if saved is not _MISSING:
                layer.__dict__["forward"] = saved
        del self.model.__dict__[_ATTR]

    def _repr_fields(self) -> dict[str, object]:
        return {"model": type(self.model).__name__, "layers": len(self.layers),
                "swap": self.swap is not None}


def _layers(model: nn.Module, layers: Iterable[nn.Module] | None) -> list[nn.Module]:
    if model.__dict__.get(_ATTR) is not None:
        raise RuntimeError(f"swap_pass.{_API}: the layers of this {type(model).__name__} are "
                           "already compiled. Call handle.remove() before compiling them again.")
    container = find_layer_blocks(model) if layers is None else layers
    found = list(container.values() if isinstance(container, nn.ModuleDict) else container)
    if not found or not all(isinstance(layer, nn.Module) for layer in found):
        raise ValueError(f"swap_pass.{_API}: layers must be one or more nn.Module blocks "
                         f"(got {[type(layer).__name__ for layer in found]}).")
    refuse_module_compile(model, found, _API)
    return found


# Note: [CUDA graphs only on CUDA]
# ``mode="reduce-overhead"`` and ``"max-autotune"`` (and ``options={"triton.cudagraphs": True}``)
# ask Inductor for CUDA graphs, which it captures only when all of a graph's tensors sit on one
# CUDA device. For a graph with no CUDA tensor it skips the capture silently, even under
# ``TORCH_LOGS="cudagraphs"`` (torch 2.13 only counts
# ``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``): the layers run as plain
# Inductor code. So compile_layers warns once when the layers it compiles are on the CPU.

# Note: [No CUDA graphs with swap]
# Under cudagraph trees a layer's output, the next layer's input, is what the swap frees. In the
# warm-up runs it lives in the trees' private memory pool: the swap returns its block to that pool
# and restores it from the normal one, and the trees' pool check (``check_memory_pool``, on by
# default) fails the step. After warm-up a replay's outputs cannot be resized: nothing is swapped.
# So compile_layers refuses CUDA graphs with ``swap=True`` on an accelerator, before the first
# step, naming what to use instead; ``swap=False`` keeps them.


def _asks_for_cuda_graphs(backend: str | Callable, compile_kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.compile(backend=backend, **compile_kwargs)`` turns on Inductor's CUDA
    graphs (Note: [CUDA graphs only on CUDA])."""
    if backend != "inductor":
        return False
    mode, options = compile_kwargs.get("mode"), compile_kwargs.get("options") or {}
    if mode not in (None, "default"):
        from torch import _inductor

        try:
            options = {**_inductor.list_mode_options(mode), **options}
        except RuntimeError:  # an unknown mode: torch.compile names it itself
            return False
    return bool(options.get("triton.cudagraphs"))


def _layers_device(found: list[nn.Module]) -> torch.device | None:
    """The device of the layers' first parameter or buffer (None: they hold neither)."""
    tensor = next((t for layer in found for t in (*layer.parameters(), *layer.buffers())), None)
    return None if tensor is None else tensor.device


def _check_cuda_graphs(found: list[nn.Module], backend: str | Callable,
                       compile_kwargs: dict[str, Any], swap: bool) -> None:
    """Warn that CUDA graphs asked for layers on the CPU are not captured (Note: [CUDA graphs
    only on CUDA]); refuse them with swap on an accelerator (Note: [No CUDA graphs with swap]).

    Raises:
        ValueError: CUDA graphs are asked for, ``swap`` is on and the layers are not on the CPU.
    """
    if not _asks_for_cuda_graphs(backend, compile_kwargs):
        return
    device = _layers_device(found)
    if device is None:
        return
    asked = (f"mode={compile_kwargs['mode']!r}" if compile_kwargs.get("mode") not in
             (None, "default") else "options={'triton.cudagraphs': True}")
    if device.type != "cpu":
        if swap:
            raise ValueError(
                f"swap_pass.{_API}: {asked} asks Inductor for CUDA graphs, which cannot run with "
                f"swapped layer inputs (layers on {device}): the graphs keep layer outputs in "
                "their private memory pool, and a swap would free them and restore them outside "
                "it. Use mode='default' or mode='max-autotune-no-cudagraphs' to swap, or "
                "swap=False to keep CUDA graphs without swapping.")
        return
    warn_once("cuda_graphs_on_cpu", _API, (
        f"swap_pass.{_API}: {asked} asks Inductor for CUDA graphs, which it captures only for "
        "tensors on a CUDA device; these layers are on the CPU, so they run as plain Inductor "
        "code, without graphs (the swap is the same as with the default mode). With swap on, "
        "layers on an accelerator refuse CUDA graphs; use mode='default' or "
        "mode='max-autotune-no-cudagraphs' there."), stacklevel=4)


def compile_layers(model: nn.Module, backend: str | Callable = "inductor", *,
                   layers: Iterable[nn.Module] | None = None, swap: bool = True,
                   config: SwapConfig | None = None, module_filter_fn: ModuleFilter = None,
                   **compile_kwargs: Any) -> CompiledLayers:
    """Compile each Transformer layer of ``model`` on its own and swap layer inputs between them.

    Args:
        model: The model; only its layers' ``forward`` is replaced (instance attributes).
        backend: Any ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, a callable), or
            ``"npu"``: torchair's ``get_npu_backend()`` (needs ``torch_npu`` and ``torchair``).
            Default: ``"inductor"``.
        layers: The blocks, in the order they run. Default: ``None``, found with
            :func:`swap_pass.eager.enable.find_layer_blocks`.
        swap: Swap each layer's input to host memory between forward and backward (the eager
            protocol of :func:`swap_pass.enable_swap_layer_input`). Default: ``True``.
        config: Runtime knobs for the swap. Default: ``SwapConfig()``.
        module_filter_fn: ``(module, fqn) -> bool``; blocks it returns False for are compiled
            but keep their input (as in :func:`swap_pass.enable_swap_layer_input`).
            Default: ``None`` (every block swaps).
        **compile_kwargs: Passed to ``torch.compile`` (``mode="max-autotune-no-cudagraphs"``,
            ``dynamic=...``, ``fullgraph=...``). CUDA graphs (``mode="reduce-overhead"``,
            ``"max-autotune"``, ``options={"triton.cudagraphs": True}``) are refused with
            ``swap=True`` on an accelerator (Note: [No CUDA graphs with swap]); on the CPU they
            are skipped with a one-time ``RuntimeWarning`` (Note: [CUDA graphs only on CUDA]).

    Returns:
        A :class:`CompiledLayers` handle; ``remove()`` or leaving ``with`` restores the model.

    Raises:
        RuntimeError: The layers are already compiled by this function, swap is already enabled
            on the model, the model or a layer was compiled with ``nn.Module.compile()``, or
            ``backend="npu"`` without torch_npu/torchair.
        ValueError: No repeated blocks were found, ``layers`` holds something else, or CUDA
            graphs are asked for with ``swap=True`` and the layers are on an accelerator.
    """
    config = check_config(config, _API)
    found = _layers(model, layers)
    _check_cuda_graphs(found, backend, compile_kwargs, swap)
    compiler = npu_backend() if backend == "npu" else backend
    saved = []
    for layer in found:
        saved.append(layer.__dict__.get("forward", _MISSING))
        layer.__dict__["forward"] = torch.compile(layer.forward, backend=compiler, **compile_kwargs)
    try:
        handle = (enable_swap_layer_input(model, layers=found, config=config,
                                          module_filter_fn=module_filter_fn) if swap else None)
    except BaseException:
        CompiledLayers(model, found, None, saved).remove()
        raise
    return CompiledLayers(model, found, handle, saved)
