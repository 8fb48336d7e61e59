"""The partition-time pass of ``swap_backend``: saved layer inputs go to host and back.

Forward graph, for the saved input ``x_i`` of every layer but the last::

    x_i  = ...                                   # made by layer i-1 (or the embedding)
    h_i  = swap_pass.swap_out(x_i)               # right away: D2H overlaps layer i
    ...                                          # layer i reads x_i
    x_i1 = ...                                   # layer i's output: layer i+1 starts here
    h_i  = swap_pass.wait(h_i, x_i)              # D2H done; x_i's last reference dies here
    return (..., h_i, ...)                       # the host copy is saved, not x_i

Backward graph (layers run last to first)::

    d_i = swap_pass.prefetch(h_i, dev, ...)      # before layer i+1's first backward node
    ...                                          # layer i+1's backward
    d_i = swap_pass.wait(d_i, h_i)               # before the first reader of x_i
    ...                                          # layer i's backward (recompute included) reads d_i

With ``SwapConfig(prefetch=False)`` the backward holds one ``swap_pass.swap_in`` per tensor,
right before its first reader. Graphs from AOTAutograd keep each node's module stack
(``nn_module_stack``; ``fwd_nn_module_stack`` on backward nodes), which is how layers are found
after partitioning. A saved tensor is swapped only if it is a layer boundary, not a graph input,
not also a user-visible output, and has a dense layout.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import fx

from swap_pass.config import SwapConfig
from swap_pass.graph import ops  # noqa: F401  (registers torch.ops.swap_pass.*)
from swap_pass.graph.boundaries import LayerFilter, find_layers

__all__ = ["SwappedTensor", "swap_saved_layer_inputs"]

log = logging.getLogger(__name__)
_OPS = torch.ops.swap_pass


@dataclasses.dataclass(frozen=True)
class SwappedTensor:
    """One saved tensor the pass moved: its name in both graphs and the layer it enters."""

    name: str
    layer: str
    nbytes: int


def _tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _host_val(val: torch.Tensor) -> torch.Tensor:
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty(val.shape, dtype=val.dtype, device="cpu")
    with mode:
        return torch.empty(val.shape, dtype=val.dtype, device="cpu")


def _static(values) -> bool:
    return all(isinstance(v, int) for v in values)


def _contiguous(val: torch.Tensor) -> bool:
    """Contiguity without adding guards on symbolic sizes (False when unknown)."""
    try:
        from torch._prims_common import is_contiguous_or_false
    except ImportError:  # older torch: static shapes only
        return _static(val.shape) and val.is_contiguous()
    return bool(is_contiguous_or_false(val))


def _set_val(node: fx.Node, val: torch.Tensor) -> None:
    from torch._subclasses.fake_tensor import extract_tensor_metadata

    node.meta["val"] = val
    try:
        node.meta["tensor_meta"] = extract_tensor_metadata(val)
    except Exception:  # symbolic strides some versions cannot describe: val is what matters
        node.meta.pop("tensor_meta", None)


def _candidates(fw: fx.GraphModule, num_fwd_outputs: int, layer_filter, config: SwapConfig):
    """(layer, node) pairs of saved layer inputs worth swapping, in forward order."""
    outputs = list(fw.graph.find_nodes(op="output")[0].args[0])
    user_outputs, saved = set(outputs[:num_fwd_outputs]), set(outputs[num_fwd_outputs:])
    layers = find_layers(fw, layer_filter, api="swap_backend")
    picked = []
    for layer, nxt in zip(layers, layers[1:]):
        x, val = layer.input, layer.input is not None and _tensor_val(layer.input)
        if x is None or val is None or x not in saved or x in user_outputs or x.op == "placeholder":
            continue
        nbytes = val.numel() * val.element_size() if _static(val.shape) else None
        if nbytes == 0 or (nbytes is not None and nbytes < config.min_swap_bytes):
            continue
        if not (_contiguous(val) or (_static(val.shape) and _static(val.stride()))):
            continue
        picked.append((layer, nxt, nbytes or 0))
    return picked


# --- forward ----------------------------------------------------------------------------------


def _after_all(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    index = {n: i for i, n in enumerate(graph.nodes)}
    last_placeholder = max((n for n in graph.nodes if n.op == "placeholder"), key=index.__getitem__)
    return max([*nodes, last_placeholder], key=index.__getitem__)


def _rewrite_forward(fw: fx.GraphModule, picked, config: SwapConfig) -> None:
    graph, output = fw.graph, fw.graph.find_nodes(op="output")[0]
    cap = -1 if config.max_host_bytes is None else config.max_host_bytes
    replace = {}
    for layer, nxt, _ in picked:
        x = layer.input
        with graph.inserting_after(_after_all(graph, [x])):
            host = graph.call_function(_OPS.swap_out.default, (x, cap, config.use_streams))
        _set_val(host, _host_val(x.meta["val"]))
        readers = [u for u in x.users if u is not host and u is not output]
        anchor = [nxt.input] if nxt.input is not None else []
        with graph.inserting_after(_after_all(graph, readers + anchor + [host])):
            waited = graph.call_function(_OPS.wait.default, (host, x))
        _set_val(waited, host.meta["val"])
        replace[x] = waited
    outs = output.args[0]
    output.update_arg(0, type(outs)(replace.get(n, n) if isinstance(n, fx.Node) else n for n in outs))


# --- backward ---------------------------------------------------------------------------------


def _layout_args(val: torch.Tensor) -> tuple[list, list]:
    """``([], [])`` (contiguous, sizes from the host tensor) or the static size and stride."""
    if _contiguous(val):
        return [], []
    return list(val.shape), list(val.stride())


def _restore_node(graph: fx.Graph, ph: fx.Node, val: torch.Tensor, first: fx.Node,
                  start: fx.Node | None, config: SwapConfig) -> fx.Node:
    size, stride = _layout_args(val)
    args = (ph, val.device, size, stride, config.use_streams)
    if start is None:  # no prefetch: one blocking swap_in before the first reader
        with graph.inserting_before(first):
            node = graph.call_function(_OPS.swap_in.default, args)
        _set_val(node, val)
        return node
    with graph.inserting_before(start):
        dev = graph.call_function(_OPS.prefetch.default, args)
    _set_val(dev, val)
    with graph.inserting_before(first):
        node = graph.call_function(_OPS.wait.default, (dev, ph))
    _set_val(node, val)
    return node


def _rewrite_backward(bw: fx.GraphModule, swapped: list[tuple], layer_filter, config: SwapConfig) -> None:
    graph = bw.graph
    index = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    bw_layers = {layer.boundary.fqn: layer for layer in find_layers(bw, layer_filter, api="swap_backend")}
    for name, _, next_fqn, val in swapped:
        ph = placeholders[name]
        _set_val(ph, _host_val(val))
        if not ph.users:
            continue
        first = min(ph.users, key=index.__getitem__)
        start = None
        if config.prefetch:
            nxt = bw_layers.get(next_fqn)
            start = min([first, *(nxt.members if nxt else [])], key=index.__getitem__)
        restored = _restore_node(graph, ph, val, first, start, config)
        ours = {restored, *restored.all_input_nodes}
        ph.replace_all_uses_with(restored, delete_user_cb=lambda u, ours=ours: u not in ours)


# --- entry ------------------------------------------------------------------------------------


def swap_saved_layer_inputs(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, *,
                            layer_filter: LayerFilter = None,
                            config: SwapConfig | None = None) -> list[SwappedTensor]:
    """Rewrite a partitioned forward/backward pair so saved layer inputs live on the host.

    Args:
        fw: The forward graph from an AOTAutograd partitioner; its outputs past
            ``num_fwd_outputs`` are the tensors saved for backward.
        bw: The matching backward graph (its placeholders carry the saved tensors' names).
        num_fwd_outputs: Number of user-visible forward outputs.
        layer_filter: Which modules are the layers; see :func:`find_layer_boundaries`.
            Default: ``None`` (guess).
        config: Runtime knobs. Default: ``SwapConfig()``.

    Returns:
        What was swapped, in forward order (empty when the graphs hold no layers).
    """
    config = config or SwapConfig()
    picked = _candidates(fw, num_fwd_outputs, layer_filter, config)
    if not picked:
        return []
    swapped = [(layer.input.name, layer.boundary.fqn, nxt.boundary.fqn, layer.input.meta["val"])
               for layer, nxt, _ in picked]
    _rewrite_forward(fw, picked, config)
    _rewrite_backward(bw, swapped, layer_filter, config)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    log.info("swap_pass: swapping %d saved layer inputs: %s", len(swapped), [s[0] for s in swapped])
    return [SwappedTensor(name, fqn, nbytes)
            for (name, fqn, _, _), (_, _, nbytes) in zip(swapped, picked)]
