"""Megatron-core: swap each Transformer layer's input with one call, or with a layer spec.

Two ways in, both on Megatron's own modules (megatron-core is imported only when called)::

    from swap_pass.integrations import megatron as sp_megatron

    handle = sp_megatron.enable(model)          # a GPTModel, a TransformerBlock, or the list of
                                               # model chunks of an interleaved pipeline
    ...train...
    handle.remove()

    spec = sp_megatron.swap_layer_spec(get_gpt_layer_local_spec())   # MindSpeed-style decorators
    model = GPTModel(config, transformer_layer_spec=spec, ...)

Note: [Which layers of a Megatron block are swapped]
    What a layer keeps for backward depends on the recompute setting of the block's config:

    * no recompute, selective recompute: every layer keeps its input: every layer is swapped;
    * full recompute, ``block``: the first ``recompute_num_layers`` layers each run in their own
      ``CheckpointFunction`` (which keeps only the input), the rest run plainly: every layer;
    * full recompute, ``uniform``: each ``CheckpointFunction`` runs ``recompute_num_layers``
      layers and keeps only the first one's input. The other layers' inputs are kept by nobody,
      so only every ``recompute_num_layers``-th layer is swapped, and its group is guarded by the
      next region's input (see Note: [Grad mode at layer entry] in ``eager/_protocol.py``).

    Each model chunk gets a tag of its own: the last swapped layer of a chunk keeps its input
    (nothing after it in the chunk could guard it; the next chunk's input arrives by p2p without
    a ``grad_fn``), so no group is left abandoned at a chunk edge under interleaved pipelines.
    Multi-token-prediction layers (``model.mtp``) are not swapped, as in MindSpeed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from swap_pass.config import SwapConfig
from swap_pass.eager.enable import SwapLayerInputHandle, enable_swap_layer_input
from swap_pass.eager.wrappers import swap_layer_input_forward_wrapper, swap_layer_input_init_wrapper
from swap_pass.handles import SwapHandle
from swap_pass.opt_out import ModuleFilter

__all__ = ["MegatronSwapHandle", "enable", "layers_to_swap", "swap_layer_spec"]

_API = "integrations.megatron"


def _unwrap(chunk: nn.Module) -> nn.Module:
    """Strip Megatron's DDP / Float16Module wrappers (each holds the model as ``.module``)."""
    while not hasattr(chunk, "decoder") and isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module
    return chunk


def _transformer_block(chunk: nn.Module) -> nn.Module:
    from megatron.core.transformer.transformer_block import TransformerBlock

    model = _unwrap(chunk)
    block = model if isinstance(model, TransformerBlock) else getattr(model, "decoder", None)
    if not isinstance(block, TransformerBlock):
        raise TypeError(
            f"swap_pass.{_API}.enable: {type(chunk).__name__} is neither a TransformerBlock nor a "
            "model with a TransformerBlock as .decoder (GPTModel). Pass a GPTModel, a "
            "TransformerBlock or a list of them."
        )
    return block


def layers_to_swap(block: nn.Module) -> list[nn.Module]:
    """The layers of a ``TransformerBlock`` whose inputs are kept for backward (Note: [Which
    layers of a Megatron block are swapped])."""
    config = block.config
    layers = list(block.layers)
    if config.recompute_granularity == "full" and config.recompute_method == "uniform":
        return layers[::max(int(config.recompute_num_layers or 1), 1)]
    return layers


class MegatronSwapHandle(SwapHandle):
    """What :func:`enable` changed: one :class:`SwapLayerInputHandle` per model chunk (see
    :class:`swap_pass.handles.SwapHandle`).

    Attributes:
        handles: One handle per chunk, in chunk order.
    """

    def __init__(self, handles: list[SwapLayerInputHandle]) -> None:
        self.handles = handles

    @property
    def layers(self) -> list[nn.Module]:
        """Every swapped layer, chunk by chunk."""
        return [layer for handle in self.handles for layer in handle.layers]

    @property
    def managers(self) -> list[Any]:
        """Every layer's manager, chunk by chunk."""
        return [m for handle in self.handles for m in handle.managers]

    @property
    def active(self) -> bool:
        """True until :meth:`remove` ran on every chunk."""
        return any(handle.active for handle in self.handles)

    def _remove(self) -> None:
        """Undo :func:`enable` on every chunk."""
        for handle in self.handles:
            handle.remove()

    def _repr_fields(self) -> dict[str, object]:
        return {"chunks": len(self.handles), "layers": len(self.layers)}


def enable(model: nn.Module | Iterable[nn.Module], *, config: SwapConfig | None = None,
           module_filter_fn: ModuleFilter = None) -> MegatronSwapHandle:
    """Swap the inputs of a Megatron model's Transformer layers to host memory.

    Args:
        model: A ``GPTModel``, a ``TransformerBlock``, or the list of model chunks Megatron's
            schedules take (each may be wrapped in DDP / ``Float16Module``).
        config: Runtime knobs. Default: ``SwapConfig()``.
        module_filter_fn: ``(module, fqn) -> bool``, asked per layer with its name in its
            ``TransformerBlock`` (``"layers.3"``); layers it returns False for keep their input.
            Default: ``None`` (every layer the recompute setting lets swap).

    Returns:
        A handle; ``handle.remove()`` restores every chunk exactly.

    Raises:
        TypeError: A chunk holds no ``TransformerBlock``.
    """
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    handles: list[SwapLayerInputHandle] = []
    try:
        for chunk in chunks:
            block = _transformer_block(chunk)
            if len(block.layers) == 0:
                continue  # a pipeline stage may hold no layer
            handles.append(enable_swap_layer_input(block, layers=layers_to_swap(block),
                                                   config=config,
                                                   module_filter_fn=module_filter_fn))
    except BaseException:
        MegatronSwapHandle(handles).remove()
        raise
    return MegatronSwapHandle(handles)


def swap_layer_spec(spec: Any, module_tag: str = "megatron") -> Any:
    """A copy of a Megatron layer ``ModuleSpec`` whose layer class carries MindSpeed's decorators.

    The layer class becomes a subclass of ``spec.module`` with
    ``@swap_layer_input_init_wrapper`` on ``__init__`` and ``@swap_layer_input_forward_wrapper``
    on ``forward`` (MindSpeed's patch of ``TransformerLayer``). Layers of virtual pipeline stage
    ``v`` register under the tag ``f"{module_tag}.vp{v}"``: one layer sequence per model chunk.
    Use a distinct ``module_tag`` per model built in one process.

    Args:
        spec: The layer spec (e.g. ``get_gpt_layer_local_spec()``); not modified.
        module_tag: Prefix of the managers' tags. Default: ``"megatron"``.
    """
    import dataclasses

    base = spec.module

    class SwapTransformerLayer(base):  # type: ignore[misc, valid-type]
        @swap_layer_input_init_wrapper
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            vp_stage = getattr(self, "vp_stage", None) or kwargs.get("vp_stage") or 0
            self.swap_module_tag = f"{module_tag}.vp{vp_stage}"

        @swap_layer_input_forward_wrapper
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    SwapTransformerLayer.__name__ = SwapTransformerLayer.__qualname__ = f"Swap{base.__name__}"
    return dataclasses.replace(spec, module=SwapTransformerLayer)
