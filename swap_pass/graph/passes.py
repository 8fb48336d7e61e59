"""``apply_swap_pass``: swap each layer's input in a traced graph that is trained in eager autograd.

The graph runs the layer-input protocol of ``swap_pass/runtime/chain.py``: each node below
calls its steps (free after the next layer, restore before backward); the pass decides where.

Graph pattern, for the input ``x_i`` of every layer but the last::

    g_i   = layer_input_swap_out(x_i)                  # layer i's entry: start D2H of x_i
    ...                                                 # layer i runs (reads x_i)
    x_i1' = layer_input_release(x_i1, g_i, g_{i-1})     # layer i+1's entry: wait D2H, free x_i
    ...                                                 # layer i+1 reads x_i1'

Note: [Restoring through autograd]
In eager autograd the layer's saved tensors reference ``x_i``'s storage, so it is freed in place
(``untyped_storage().resize_(0)``) and its data comes back into it (:class:`swap_pass.SwapTensors`
does both). ``layer_input_release`` is an autograd Function on the stream entering layer ``i+1``:
its backward runs once layer ``i``'s output gradient is complete, before any backward node of
layer ``i`` (its recompute included). There it waits for ``x_i``'s host-to-device copy (starting
it if nobody did) and starts ``x_{i-1}``'s, one layer ahead. Each forward's groups are graph
values, so several forwards before one backward (gradient accumulation) stay separate, and a
forward whose graph is dropped gives its host buffers back (``SwapTensors.__del__``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch import fx

from swap_pass.config import SwapConfig, check_config
from swap_pass.graph.boundaries import LayerFilter, find_layers, with_module_filter
from swap_pass.opt_out import ModuleFilter, check_module_filter, swap_allowed
from swap_pass.runtime.chain import free_if_unheld, prefetch_ahead, restore_for_backward
from swap_pass.runtime.freeing import autograd_mark, swappable_layer_inputs
from swap_pass.runtime.group import SwapTensors
from swap_pass.runtime.stats import SkipReason, record_skip

__all__ = ["apply_swap_pass", "layer_input_release", "layer_input_swap_out"]

_SWAP_OUT_PREFIX = "swap_pass_out_"
_RELEASE_PREFIX = "swap_pass_release_"


# --- what the graph calls ---------------------------------------------------------------------


def _config_key(config: SwapConfig) -> tuple:
    return tuple(getattr(v, "value", v) for v in dataclasses.astuple(config))


@functools.lru_cache(maxsize=64)
def _config_from_key(key: tuple) -> SwapConfig:
    return SwapConfig(*key)


def layer_input_swap_out(x: torch.Tensor, name: str, config: tuple) -> SwapTensors | None:
    """Start the device-to-host copy of a layer's input; ``None`` when no backward will need it."""
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad):
        return None
    if not swap_allowed():  # Note: [Opting out] in swap_pass/opt_out.py
        record_skip(SkipReason.NO_SWAP, x.numel() * x.element_size(), where=name)
        return None
    if not swappable_layer_inputs([x], name):  # see Note: [Ownership rule] in runtime/freeing.py
        return None
    group = SwapTensors([x], config=_config_from_key(config), name=name, copy_span=True)
    group.swap_to_host()
    group.entry_mark = autograd_mark()
    return group


class _ReleaseLayerInput(torch.autograd.Function):
    """Identity on the stream entering the next layer: frees the group, restores it in backward."""

    @staticmethod
    def forward(ctx, x_next, group, earlier):
        if not free_if_unheld(group, group.name, [x_next]):
            group.restore()  # another holder is left (Note: [Ownership rule]): keep it on device
        ctx.group, ctx.earlier = group, earlier
        return x_next.view_as(x_next)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group is None:  # a second backward (retain_graph=True): already restored
            return grad, None, None
        restore_for_backward(ctx.group)  # see Note: [Restoring through autograd]
        earlier = ctx.earlier
        if earlier is not None and earlier.config.prefetch:
            prefetch_ahead((earlier,), earlier.config)
        # The node lives until the loss dies: drop the groups so autograd frees restored inputs.
        ctx.group = ctx.earlier = None
        return grad, None, None


def layer_input_release(x_next: torch.Tensor, group: SwapTensors | None,
                        earlier: SwapTensors | None) -> torch.Tensor:
    """At the next layer's entry: free ``group``'s device storage; restore it in backward."""
    if group is None:
        return x_next
    return _ReleaseLayerInput.apply(x_next, group, earlier)


torch.fx.wrap("layer_input_swap_out")
torch.fx.wrap("layer_input_release")


# --- the pass ---------------------------------------------------------------------------------


def _entry_point(layer, index: dict[fx.Node, int]) -> fx.Node:
    """The first node of the layer that runs after its input exists."""
    after = [n for n in layer.members if index[n] > index[layer.input]]
    return min(after, key=index.__getitem__)


def _swappable(layer, next_layer) -> bool:
    """The input may be freed at the next layer's entry only if nothing after that reads it."""
    x = layer.input
    if x is None or next_layer.input is None:
        return False
    outside = [u.name for u in x.users if u not in set(layer.members)]
    if outside:
        warnings.warn(
            f"swap_pass.apply_swap_pass: the input {x.name} of {layer.boundary.fqn} is also read "
            f"by {outside} outside the layer; it is not swapped.", stacklevel=3)
    return not outside


def _insert(graph: fx.Graph, where: fx.Node, target, args: tuple, name: str, val=None) -> fx.Node:
    with graph.inserting_before(where):
        node = graph.create_node("call_function", target, args, name=name)
    if val is not None:
        node.meta["val"] = val
    return node


def _maybe_shape_prop(gm: fx.GraphModule, example_inputs) -> None:
    has_meta = any(("val" in n.meta or "tensor_meta" in n.meta) for n in gm.graph.nodes)
    if example_inputs is not None and not has_meta:
        from torch.fx.passes.shape_prop import ShapeProp

        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)


def apply_swap_pass(gm: fx.GraphModule, example_inputs=None, *, layer_filter: LayerFilter = None,
                    config: SwapConfig | None = None,
                    module_filter_fn: ModuleFilter = None) -> fx.GraphModule:
    """Insert swap nodes at every layer boundary but the last, for training in eager autograd.

    Args:
        gm: A ``torch.fx.GraphModule`` from ``torch.fx.symbolic_trace``, a Dynamo backend, or
            ``torch.export(...).module()``. Modified in place and returned.
        example_inputs: Inputs to run shape propagation with when the graph has no shape
            metadata (helps find the first layer's input). Default: ``None``.
        layer_filter: Which modules are the layers; see :func:`find_layer_boundaries`.
            Default: ``None`` (guess).
        config: Runtime knobs (host cap, prefetch, streams...). Default: ``SwapConfig()``.
        module_filter_fn: ``(module, fqn) -> bool``; layers it returns False for keep their
            input (``module`` is ``gm``'s submodule of that name). Default: ``None`` (all).

    Returns:
        ``gm``, whose forward swaps each layer's input out at the layer's entry, frees it at the
        next layer's entry and brings it back before the layer's backward (bitwise-equal grads).

    Raises:
        TypeError: ``gm`` is not a GraphModule. ValueError: ``layer_filter`` matches nothing.
    """
    from swap_pass.graph.boundaries import _check_graph_module

    _check_graph_module(gm, "apply_swap_pass")
    config = check_config(config, "apply_swap_pass")
    check_module_filter(module_filter_fn, "apply_swap_pass")
    _maybe_shape_prop(gm, example_inputs)
    layers = find_layers(gm, with_module_filter(layer_filter, module_filter_fn),
                         api="apply_swap_pass")
    if len(layers) < 2:
        warnings.warn(f"swap_pass.apply_swap_pass: found {len(layers)} layer(s); nothing to swap. "
                      "Pass layer_filter to name the repeated blocks.", stacklevel=2)
        return gm
    _rewrite(gm.graph, layers, _config_key(config))
    gm.meta["swap_pass_layers"] = [layer.boundary for layer in layers]
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(graph: fx.Graph, layers: list, config: tuple) -> None:
    index = {n: i for i, n in enumerate(graph.nodes)}
    entries = [_entry_point(layer, index) if layer.input is not None else None
               for layer in layers]
    # consecutive pairs
    swappable = [_swappable(a, b) for a, b in zip(layers, layers[1:], strict=False)] + [False]
    groups: list[fx.Node | None] = [None] * len(layers)
    for i, layer in enumerate(layers):
        x = layer.input
        if i and groups[i - 1] is not None:
            earlier = next((g for g in reversed(groups[:i - 1]) if g is not None), None)
            release = _insert(graph, entries[i], layer_input_release, (x, groups[i - 1], earlier),
                              _RELEASE_PREFIX + layers[i - 1].boundary.fqn.replace(".", "_"),
                              x.meta.get("val"))
            x.replace_all_uses_with(release, delete_user_cb=lambda u, r=release: u is not r)
            x = release
        if swappable[i]:
            groups[i] = _insert(graph, entries[i], layer_input_swap_out,
                                (x, layer.boundary.fqn, config),
                                _SWAP_OUT_PREFIX + layer.boundary.fqn.replace(".", "_"))
