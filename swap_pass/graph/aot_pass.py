"""The partition-time pass of ``swap_backend``: saved layer inputs go to host and back.

Forward graph, for the saved input ``x_i`` of every layer but the last::

    x_i  = ...                                   # made by layer i-1 (or the embedding)
    h_i  = swap_pass.swap_out(x_i)               # right away: D2H overlaps layer i
    ...                                          # layer i reads x_i
    x_i1 = ...                                   # layer i's output: layer i+1 starts here
    h_i  = swap_pass.wait(h_i, x_i)              # D2H done; x_i's last reference dies here
    return (..., h_i, ...)                       # the host copy is saved, not x_i

Backward graph (layers run last to first)::

    y   = ...                                    # the last matmul before layer i+1's backward
    d_i = swap_pass.prefetch(h_i, dev, ..., y)   # here, and not before y (see _pin_after_compute)
    ...                                          # layer i+1's backward
    d_i = swap_pass.wait(d_i, h_i)               # before the first reader of x_i
    ...                                          # layer i's backward (recompute included) reads d_i

With ``SwapConfig(prefetch=False)`` the backward holds one ``swap_pass.swap_in`` per tensor,
right before its first reader. Layers are found from each node's module stack, which AOTAutograd
keeps (``nn_module_stack``; ``fwd_nn_module_stack`` on backward nodes). A saved tensor is swapped
only if it is a layer boundary, not a graph input nor a user-visible output, and contiguous or
of static strides.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

from swap_pass.config import SwapConfig
from swap_pass.graph import ops  # registers torch.ops.swap_pass.*
from swap_pass.graph.boundaries import LayerFilter, find_layers
from swap_pass.graph.budget import Budget, CostModel, choose_swaps

__all__ = ["SwappedTensor", "swap_saved_layer_inputs", "swap_within_budget", "why_nothing_swapped"]

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
        return ops.empty_host_like(val)
    with mode:
        return ops.empty_host_like(val)


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


def _saved(fw: fx.GraphModule, num_fwd_outputs: int) -> tuple[set, set]:
    outputs = list(fw.graph.find_nodes(op="output")[0].args[0])
    return set(outputs[:num_fwd_outputs]), set(outputs[num_fwd_outputs:])


def _swappable_bytes(x: fx.Node | None, saved: set, user_outputs: set,
                     config: SwapConfig, *, hinted: bool = False) -> int | None:
    """Bytes of saved ``x`` if the pass may swap it (0 when unknown, symbolic), else ``None``;
    with ``hinted`` (budget mode) symbolic sizes count with their hints, 0 without one
    (Note: [Planning with symbolic sizes] in budget.py)."""
    val = None if x is None else _tensor_val(x)
    if val is None or x not in saved or x in user_outputs or x.op == "placeholder":
        return None
    nbytes = val.numel() * val.element_size() if _static(val.shape) else None
    if nbytes is None and hinted:
        from swap_pass.graph.budget import hinted_shape

        shape = hinted_shape(val)
        nbytes = None if shape is None else int(torch.Size(shape).numel()) * val.element_size()
    if nbytes == 0 or (nbytes is not None and nbytes < config.min_swap_bytes):
        return None
    if not (_contiguous(val) or (_static(val.shape) and _static(val.stride()))):
        return None
    return nbytes or 0


@dataclasses.dataclass
class _Planned:
    """A saved tensor to swap and where its waits and prefetch go: ``wait_after``, forward nodes
    the D2H wait must follow (besides ``node``'s readers); ``prefetch_before``, the backward node
    its H2D copy starts before (``None``: ``next_layer``'s)."""

    node: fx.Node
    layer: str
    nbytes: int
    wait_after: list[fx.Node]
    prefetch_before: fx.Node | None = None
    next_layer: str | None = None


def _layer_inputs(fw: fx.GraphModule, num_fwd_outputs: int, layer_filter,
                  config: SwapConfig) -> tuple[list[_Planned], list]:
    """Saved layer inputs worth swapping, in forward order, and the graph's layers (the last
    layer's too when nothing after it computes here: Note: [Layers across graph breaks])."""
    user_outputs, saved = _saved(fw, num_fwd_outputs)
    layers = find_layers(fw, layer_filter, api="swap_backend", strict=False)
    pairs = list(zip(layers, layers[1:], strict=False))  # consecutive pairs
    if layers and _ends_the_graph(fw, layers[-1]):
        pairs.append((layers[-1], None))
    picked = []
    for layer, nxt in pairs:
        x = _saved_base(layer.input, saved)
        nbytes = _swappable_bytes(x, saved, user_outputs, config)
        if nbytes is None:
            _count_kept(x, saved, user_outputs, config)
            continue
        anchor = [nxt.input] if nxt is not None and nxt.input is not None else []
        picked.append(_Planned(x, layer.boundary.fqn, nbytes, anchor,
                               next_layer=nxt.boundary.fqn if nxt is not None else None))
    return picked, layers


# Note: [Every chosen tensor swapped or counted]
# A saved layer input the rule chose but may not swap stays on the device, counted in swap_stats()
# with its reason at partition time, so that swapped plus counted is every saved input the rule
# chose: a graph input (the user's input, a parameter: user_data), also a forward output
# (shared_storage: the caller holds it), empty (no_storage), under min_swap_bytes (too_small), or
# of a size or layout unknown when compiling (dynamic_shape). sac_tags.plan_offloads counts tagged
# offloads, _count_unplanned budget mode's. A layer input the partitioner did not save: not chosen.


def _count_kept(x: fx.Node | None, saved: set, user_outputs: set, config: SwapConfig) -> None:
    """Count a saved layer input the rule chose but keeps, with its reason (Note: [Every chosen
    tensor swapped or counted])."""
    if x is None or x not in saved:
        return
    from swap_pass.runtime.stats import SkipReason, record_skip

    val = _tensor_val(x)
    nbytes = val.numel() * val.element_size() if val is not None and _static(val.shape) else 0
    if x.op == "placeholder":
        reason = SkipReason.USER_DATA
    elif x in user_outputs:
        reason = SkipReason.SHARED_STORAGE
    elif val is None or (nbytes == 0 and _static(val.shape)):
        reason = SkipReason.NO_STORAGE
    elif 0 < nbytes < config.min_swap_bytes:
        reason = SkipReason.TOO_SMALL
    else:  # symbolic sizes or strides
        reason = SkipReason.DYNAMIC_SHAPE
    record_skip(reason, nbytes, warn=False)


def _saved_base(x: fx.Node | None, saved: set) -> fx.Node | None:
    """``x``, or the saved tensor that ``x``, an unsaved view (``_unsafe_view`` too), views whole:
    a classic tensor-parallel plan's first layer reads ``view(wait_tensor(all_reduce(...)))``,
    and the wait's result is saved."""
    node = x
    while (node is not None and node not in saved and node.op == "call_function"
           and node.target is not operator.getitem
           and (_is_view_op(node) or node.target is torch.ops.aten._unsafe_view.default)
           and node.args and isinstance(node.args[0], fx.Node)
           and _numel(node.args[0]) == _numel(node) is not None):
        node = node.args[0]
    return node if node is not None and node in saved else x


def _numel(node: fx.Node) -> int | None:
    val = _tensor_val(node)
    return val.numel() if val is not None and _static(val.shape) else None


# Note: [Layers across graph breaks]
# With a graph break between layers (a print, a data-dependent branch), Dynamo compiles the layers
# on each side as separate graphs. The first graph's last layer is not the model's: its saved
# input lives through the next graph's forward and backward, so it is swapped too. A layer is the
# *model's* last when compute the layers do not own follows it in its graph (the final norm, the
# head, the loss); when only the graph's output follows, more layers are assumed in another graph.
# Its H2D copy starts at the top of its graph's backward (right after the next graph's backward),
# and its D2H wait goes after the layer's own compute.


def _ends_the_graph(fw: fx.GraphModule, last) -> bool:
    """Nothing outside ``last`` computes on what it makes: its values only leave the graph."""
    members = set(last.members)
    return not any(_computes_on(u, members) for n in last.members for u in n.users)


def _computes_on(user: fx.Node, members: set) -> bool:
    if user in members or user.op == "output":
        return False
    if user.op == "call_function" and _is_view_op(user):
        return any(_computes_on(u, members) for u in user.users)
    return True


def _is_view_op(node: fx.Node) -> bool:
    import operator

    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


# --- forward ----------------------------------------------------------------------------------


def _after_all(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    index = {n: i for i, n in enumerate(graph.nodes)}
    last_placeholder = max((n for n in graph.nodes if n.op == "placeholder"), key=index.__getitem__)
    return max([*nodes, last_placeholder], key=index.__getitem__)


def _last_tensor_before(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """The last matmul-class result before ``node``, always one tensor (``after`` is ``Tensor?``):
    what a wait or prefetch there must come after.

    Note: [Which tensor a wait or prefetch depends on]
    A matmul's result is an extern kernel's output every compiler materialises anyway, so
    depending on it pins the wait without changing what Inductor fuses (a pointwise intermediate
    would be forced into memory and could round differently, e.g. FMA contraction). Attention
    kernels in ``flop_registry`` return tuples (CUDA since torch 2.13, the CPU flash kernel since
    2.15): the ``getitem`` taking a tensor out of the tuple is depended on, never the tuple.
    """
    cur = node.prev
    while cur.op != "root":
        if _is_compute_result(cur):
            return cur
        cur = cur.prev
    return None


def _is_compute_result(node: fx.Node) -> bool:
    """``node`` is one tensor made by a matmul-class op (directly, or taken out of its tuple)."""
    import operator

    from torch.utils.flop_counter import flop_registry

    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    source = node
    if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        source = node.args[0]
    return (source.op == "call_function"
            and getattr(source.target, "overloadpacket", None) in flop_registry)


def _insert_wait(graph: fx.Graph, t: fx.Node, keepalive: fx.Node, where: fx.Node,
                 after: bool) -> fx.Node:
    """``wait(t, keepalive, dep)`` after/before ``where``, ``dep`` the tensor computed before."""
    ctx = graph.inserting_after(where) if after else graph.inserting_before(where)
    with ctx:
        node = graph.call_function(_OPS.wait.default, (t, keepalive, None))
    dep = _last_tensor_before(graph, node)
    if dep is not None and dep not in (t, keepalive):
        node.update_arg(2, dep)
    _set_val(node, t.meta["val"])
    return node


# Note: [One buffer from swap_out to wait]
# swap_out's D2H copy reads x until the compute stream waits for it at ``wait(h, keepalive=x)``,
# one layer later; the graph must hold x's buffer, unwritten, up to that wait. Under aot_eager x
# is one tensor. Inductor lowers an unrealized pointwise x (the residual add making a layer input)
# lazily: swap_out's stride constraint (Note: [swap_out's input layout] in ops.py) realizes a
# private copy of x for the op, and the keepalive recomputes x into a second buffer. The copy's
# buffer then dies right after swap_out (its finalizer orders compute after the D2H at once: no
# overlap, plus an activation-sized extra buffer), or memory planning hands it to a later kernel
# while the D2H reads it (``reinterpret_tensor(buf); del buf  # reuse``: a corrupted host copy on
# an asynchronous device). ``meta["inductor_realize_to_strides"]``, set by Inductor's own FX
# passes on nodes to realize, makes Inductor realize x once, where it is made, with its traced
# strides (as the constraint asks): swap_out and the wait read one buffer, last used by the wait.
# Other compilers ignore the key.


def _rewrite_forward(fw: fx.GraphModule, planned: list[_Planned], config: SwapConfig) -> None:
    graph, output = fw.graph, fw.graph.find_nodes(op="output")[0]
    cap = -1 if config.max_host_bytes is None else config.max_host_bytes
    replace = {}
    for p in planned:
        x = p.node
        x.meta["inductor_realize_to_strides"] = True  # Note: [One buffer from swap_out to wait]
        with graph.inserting_after(_after_all(graph, [x])):
            host = graph.call_function(_OPS.swap_out.default,
                                       (x, cap, config.use_streams, config.pin_memory))
        _set_val(host, _host_val(x.meta["val"]))
        readers = [u for u in x.users if u is not host and u is not output]
        replace[x] = _insert_wait(graph, host, x,
                                  _after_all(graph, readers + p.wait_after + [host]), after=True)
    outs = output.args[0]
    output.update_arg(0, type(outs)(replace.get(n, n) if isinstance(n, fx.Node) else n
                                    for n in outs))


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
    _pin_after_compute(dev, args)
    _set_val(dev, val)
    return _insert_wait(graph, dev, ph, first, after=False)


def _pin_after_compute(prefetch: fx.Node, args: tuple) -> None:
    """Make ``prefetch`` depend on the matmul computed before it, so that it cannot start early.

    Else Inductor's peak-memory reordering may hoist every prefetch to the top of the backward,
    bringing every swapped tensor back for the last layers' backward, a checkpointed step's peak.
    """
    dep = _last_tensor_before(prefetch.graph, prefetch)
    if dep is not None:
        prefetch.args = (*args, dep)


def _prefetch_start(p: _Planned, first: fx.Node, bw_layers: dict, index: dict) -> fx.Node:
    if p.prefetch_before is not None:
        return min([first, p.prefetch_before], key=index.__getitem__)
    if p.next_layer is None:  # the graph's last layer (Note: [Layers across graph breaks])
        return next(n for n in first.graph.nodes if n.op != "placeholder")
    nxt = bw_layers.get(p.next_layer)
    return min([first, *(nxt.members if nxt else [])], key=index.__getitem__)


def _rewrite_backward(bw: fx.GraphModule, planned: list[_Planned], layer_filter,
                      config: SwapConfig) -> None:
    graph = bw.graph
    index = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    bw_layers = {}
    if config.prefetch and any(p.prefetch_before is None for p in planned):
        bw_layers = {layer.boundary.fqn: layer
                     for layer in find_layers(bw, layer_filter, api="swap_backend", strict=False)}
    for p in planned:
        ph, val = placeholders[p.node.name], p.node.meta["val"]
        _set_val(ph, _host_val(val))
        if not ph.users:
            continue
        first = min(ph.users, key=index.__getitem__)
        start = _prefetch_start(p, first, bw_layers, index) if config.prefetch else None
        restored = _restore_node(graph, ph, val, first, start, config)
        ours = {restored, *restored.all_input_nodes}
        ph.replace_all_uses_with(restored, delete_user_cb=lambda u, ours=ours: u not in ours)


# --- entry ------------------------------------------------------------------------------------


def _apply(fw: fx.GraphModule, bw: fx.GraphModule, planned: list[_Planned], layer_filter,
           config: SwapConfig) -> list[SwappedTensor]:
    if planned:
        _rewrite_forward(fw, planned, config)
        _rewrite_backward(bw, planned, layer_filter, config)
        for gm in (fw, bw):
            gm.graph.lint()
            gm.recompile()
    log.info("swap_pass: swapping %d saved tensors: %s", len(planned),
             [p.node.name for p in planned])
    return [SwappedTensor(p.node.name, p.layer, p.nbytes) for p in planned]


def swap_saved_layer_inputs(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, *,
                            layer_filter: LayerFilter = None, config: SwapConfig | None = None,
                            offload_tags: dict | None = None) -> list[SwappedTensor]:
    """Rewrite a partitioned forward/backward pair so saved layer inputs live on the host.

    Args:
        fw: The forward graph from an AOTAutograd partitioner; its outputs past
            ``num_fwd_outputs`` are the tensors saved for backward.
        bw: The matching backward graph (its placeholders carry the saved tensors' names).
        num_fwd_outputs: Number of user-visible forward outputs.
        layer_filter: Which modules are the layers; see :func:`find_layer_boundaries`.
            Default: ``None`` (guess).
        config: Runtime knobs. Default: ``SwapConfig()``.
        offload_tags: Selective-checkpoint offload tags taken from the joint graph
            (:func:`swap_pass.graph.sac_tags.take_offload_tags`): those saved nodes are swapped
            too. Default: ``None``.

    Returns:
        What was swapped, in forward order (empty when the graphs hold no layers, or layers none
        of whose inputs is saved: e.g. GPT-2, whose partitioner saves LayerNorm's output
        instead; :func:`why_nothing_swapped` says which, and ``swap_backend`` warns).
    """
    config = config or SwapConfig()
    planned, _ = _layer_inputs(fw, num_fwd_outputs, layer_filter, config)
    planned = _with_offloads(fw, num_fwd_outputs, planned, offload_tags, layer_filter, config)
    return _apply(fw, bw, planned, layer_filter, config)


def _with_offloads(fw: fx.GraphModule, num_fwd_outputs: int, planned: list[_Planned],
                   offload_tags: dict | None, layer_filter, config: SwapConfig) -> list[_Planned]:
    """``planned`` and the saved nodes tagged ``*_CPU_OFFLOAD``, in forward order."""
    if not offload_tags:
        return planned
    from swap_pass.graph.sac_tags import plan_offloads

    extra = plan_offloads(fw, num_fwd_outputs, offload_tags, layer_filter=layer_filter,
                          config=config, exclude={p.node for p in planned})
    index = {n: i for i, n in enumerate(fw.graph.nodes)}
    return sorted([*planned, *extra], key=lambda p: index[p.node])


def why_nothing_swapped(fw: fx.GraphModule, num_fwd_outputs: int, layer_filter) -> tuple[str, int]:
    """Why layer-input mode swapped nothing in ``fw``, and the bytes it saves for backward."""
    _, saved = _saved(fw, num_fwd_outputs)
    nbytes = sum(v.numel() * v.element_size() for n in saved if isinstance(n, fx.Node)
                 and (v := _tensor_val(n)) is not None and _static(v.shape))
    layers = find_layers(fw, layer_filter, api="swap_backend", strict=False)
    if layer_filter is not None and not layers:
        return f"layer_filter={layer_filter!r} matches none of its modules", nbytes
    if not layers:
        return ("it holds no family of repeated layer blocks. If a graph break inside the layer "
                "loop gave each layer a graph of its own (FSDP2's fully_shard does: Dynamo runs "
                "its hooks eagerly, so each fully_shard block compiles on its own), use "
                "swap_pass.compile_layers(model), which swaps between layers outside the compiled "
                "regions, or remove the break; else name the layers with layer_filter"), nbytes
    if len(layers) == 1:
        return (f"it holds one layer ({layers[0].boundary.fqn}), the model's last, whose input "
                "backward needs at once"), nbytes
    return (f"it holds {len(layers)} layers but saves none of their inputs for backward (the "
            "partitioner saved other tensors, e.g. LayerNorm outputs). Use "
            "make_swap_backend(memory_budget=...) to swap any saved tensor, or checkpoint the "
            "layers"), nbytes


def _owner(gm: fx.GraphModule, node: fx.Node) -> str:
    from swap_pass.graph.boundaries import _node_modules

    modules = _node_modules(gm, node)
    return modules[-1][0] if modules else ""


def _count_unplanned(nodes) -> None:
    """Saved tensors of sizes without a hint: never a silent zero (``dynamic_shape``)."""
    from swap_pass.runtime.stats import SkipReason, record_skip

    for _n in nodes:
        record_skip(SkipReason.DYNAMIC_SHAPE, 0, where="swap_backend (budget mode)",
                    detail="Its size is data-dependent (unbacked), so budget mode cannot plan it.")


def swap_within_budget(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, *,
                       budget: Budget, cost: CostModel, config: SwapConfig | None = None,
                       offload_tags: dict | None = None) -> tuple[list[SwappedTensor], int, int]:
    """Rewrite a partitioned pair so the predicted peak fits ``budget`` (any saved tensor moves).

    Args:
        fw, bw, num_fwd_outputs: As for :func:`swap_saved_layer_inputs`.
        budget: Target peak of the bytes the graphs make (see :mod:`swap_pass.graph.budget`).
        cost: Copy bandwidth and FLOP rate; measured on the graph's device where ``None``.
        config: Runtime knobs. Default: ``SwapConfig()``.
        offload_tags: As for :func:`swap_saved_layer_inputs`: swapped besides the budget's
            choice (which does not count them). Default: ``None``.

    Returns:
        What was swapped in forward order, the predicted peak without swap, and with it.
    """
    config = config or SwapConfig()
    forced = _with_offloads(fw, num_fwd_outputs, [], offload_tags, None, config)
    user_outputs, saved = _saved(fw, num_fwd_outputs)
    saved = saved - {p.node for p in forced}
    in_order = dict.fromkeys(fw.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:])
    # graph order, not set order: ties in the choice then break the same way in every process
    sizes = {n: _swappable_bytes(n, saved, user_outputs, config, hinted=True)
             for n in in_order if isinstance(n, fx.Node)}
    candidates = [(n, nb) for n, nb in sizes.items() if nb]
    _count_unplanned(n for n, nb in sizes.items() if nb == 0)
    device = next((v.device for n, _ in candidates if (v := _tensor_val(n)) is not None), None)
    if device is None:
        return _apply(fw, bw, forced, None, config), 0, 0
    choices, before, after = choose_swaps(fw, bw, candidates, budget, cost.resolved(device))
    planned = [_Planned(c.node, _owner(fw, c.node), c.nbytes, [c.wait_after], c.prefetch_before)
               for c in choices]
    return _apply(fw, bw, [*planned, *forced], None, config), before, after
