"""Find the repeated layer blocks of a graph and the tensor entering each (the residual stream).

* ``torch.fx.symbolic_trace``: layers are ``call_module`` nodes (``layers.0``, ``layers.1``...);
  the entering tensor is the node's first argument.
* Dynamo, ``torch.export`` and AOTAutograd graphs: each node's ``meta["nn_module_stack"]`` names
  the modules it ran in (``meta["fwd_nn_module_stack"]`` on backward nodes); layer ``i``'s
  entering tensor is the value made outside it that it reads, of the residual stream's shape.

Without ``layer_filter`` the layers are the outermost family of same-class blocks under one parent
(``model.layers.0``, ``model.layers.1``...; ``ModuleDict`` keys and named attributes too), the
rule the eager finder uses (Note: [The layer family rule] in ``swap_pass/layer_family.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from collections.abc import Callable, Sequence

import torch
from torch import fx

__all__ = ["LayerBoundary", "LayerFilter", "ModuleFiltered", "find_layer_boundaries",
           "normalize_fqn", "with_module_filter"]

log = logging.getLogger(__name__)

LayerFilter = str | type | Sequence[type] | Callable[[str, object], bool] | None


@dataclasses.dataclass(frozen=True)
class ModuleFiltered:
    """A layer filter narrowed by a ``module_filter_fn(module, fqn)`` (Note: [Opting out] in
    ``swap_pass/opt_out.py``): the layers ``layer_filter`` selects, less those it refuses.

    ``module`` is the graph's submodule of that name if any (``symbolic_trace`` keeps a plain
    ``nn.Module`` with the layer's parameters), else ``None`` (Dynamo, AOTAutograd: names only).
    """

    layer_filter: LayerFilter
    module_filter_fn: Callable[[object, str], bool]

    def keeps(self, gm: fx.GraphModule, fqn: str) -> bool:
        """Whether the filter keeps the layer ``fqn`` of ``gm``."""
        try:
            module = gm.get_submodule(fqn)
        except AttributeError:
            module = None
        return bool(self.module_filter_fn(module, fqn))


def with_module_filter(layer_filter: LayerFilter, module_filter_fn) -> LayerFilter:
    """``layer_filter`` narrowed by ``module_filter_fn`` (itself when that is None)."""
    if module_filter_fn is None:
        return layer_filter
    return ModuleFiltered(layer_filter, module_filter_fn)


@dataclasses.dataclass(frozen=True)
class LayerBoundary:
    """One layer of the graph and the tensor that enters it.

    Attributes:
        index: Position of the layer in the sequence (0 for the first).
        fqn: The layer's module name, e.g. ``"model.layers.3"``.
        layer_type: The layer's class name.
        node: Name of the graph node that holds the layer's input (``None`` when not found).
        first_node: Name of the first node that runs inside the layer.
        last_node: Name of the last node that runs inside the layer.
    """

    index: int
    fqn: str
    layer_type: str
    node: str | None
    first_node: str
    last_node: str

    def __str__(self) -> str:
        return (f"layer {self.index} {self.fqn} ({self.layer_type}): input {self.node}, "
                f"nodes {self.first_node}..{self.last_node}")


# --- module names -----------------------------------------------------------------------------

_PREFIX = re.compile(r"^[A-Za-z_]\w*\['[^']*'\](?:\[\d+\])*\.?")


def normalize_fqn(path: str) -> str:
    """Turn Dynamo's ``L['self'].layers[0]`` / ``._modules['x']`` spellings into ``layers.0``."""
    path = re.sub(r"\.?_modules\['([^']+)'\]", r".\1", path)
    path = _PREFIX.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _type_name(cls: object) -> str:
    if isinstance(cls, str):
        return cls.rsplit(".", 1)[-1]
    return getattr(cls, "__name__", str(cls))


def _node_modules(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, object]]:
    """The (fqn, class) of every module ``node`` ran in, outermost first."""
    if node.op == "call_module":
        names = str(node.target).split(".")
        return [(".".join(names[:i]), type(gm.get_submodule(".".join(names[:i]))))
                for i in range(1, len(names) + 1)]
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return _subgraph_modules(gm, node)
    return [(normalize_fqn(path), cls) for path, cls in stack.values()]


def _subgraph_modules(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, object]]:
    """For a higher-order op (Dynamo's activation checkpoint): the modules all its body ran in."""
    body = node.args[0] if node.op == "call_function" and node.args else None
    if not (isinstance(body, fx.Node) and body.op == "get_attr"):
        return []
    sub = getattr(gm, str(body.target), None)
    if not isinstance(sub, fx.GraphModule):
        return []
    stacks = [_node_modules(sub, n) for n in sub.graph.nodes
              if n.op not in ("placeholder", "output")]
    stacks = [s for s in stacks if s]
    common = stacks[0] if stacks else []
    for s in stacks[1:]:
        # the shorter stack bounds the common prefix
        common = [a for a, b in zip(common, s, strict=False) if a[0] == b[0]]
    return common


def _all_modules(gm: fx.GraphModule) -> dict[str, object]:
    """Modules the nodes ran in, in first-run order (a leaf ``call_module`` adds its submodules)."""
    seen: dict[str, object] = {}
    for node in gm.graph.nodes:
        for fqn, cls in _node_modules(gm, node):
            seen.setdefault(fqn, cls)
        if node.op == "call_module":
            for name, sub in gm.get_submodule(str(node.target)).named_modules(
                    prefix=str(node.target)):
                seen.setdefault(name, type(sub))
    return seen


def _guess_layers(modules: dict[str, object]) -> list[str]:
    """The layer family (Note: [The layer family rule] in swap_pass/layer_family.py)."""
    from swap_pass.layer_family import choose_layer_family

    named = {fqn: _type_name(cls) for fqn, cls in modules.items()}
    for fqn in list(named):  # a parent no node ran in has no forward: a ModuleList/ModuleDict
        parent = fqn.rpartition(".")[0]
        if "." in fqn and parent not in named:
            named[parent] = "ModuleList"
    return choose_layer_family(named)


def _matches(layer_filter: LayerFilter, fqn: str, cls: object) -> bool:
    if isinstance(layer_filter, str):
        return re.fullmatch(layer_filter, fqn) is not None
    if isinstance(layer_filter, type):
        layer_filter = (layer_filter,)
    if isinstance(layer_filter, (tuple, list)):
        return any(cls is c or (isinstance(cls, str) and cls.rsplit(".", 1)[-1] == c.__name__)
                   for c in layer_filter)
    return bool(layer_filter(fqn, cls))


def _select_layers(modules: dict[str, object], layer_filter: LayerFilter) -> list[str]:
    if layer_filter is None:
        chosen = _guess_layers(modules)
    else:
        chosen = [f for f, c in modules.items() if _matches(layer_filter, f, c)]
    outer = [f for f in chosen if not any(f.startswith(o + ".") for o in chosen if o != f)]
    if all(f.rpartition(".")[2].isdigit() for f in outer):
        return sorted(outer, key=_index_key)
    return outer  # ModuleDict keys, named attributes: the order they first run in


def _index_key(fqn: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in fqn.split("."))


def _layer_of(gm: fx.GraphModule, node: fx.Node, layers: set[str]) -> str | None:
    """The selected layer ``node`` ran in, if any."""
    for fqn, _ in _node_modules(gm, node):
        if fqn in layers:
            return fqn
    return None


def _shape_key(node: fx.Node) -> str | None:
    val = node.meta.get("val", node.meta.get("example_value", node.meta.get("tensor_meta")))
    if isinstance(val, torch.Tensor) or type(val).__name__ == "TensorMetadata":
        return f"{tuple(val.shape)}:{val.dtype}"
    return None


def _external_inputs(members: list[fx.Node], fqn: str,
                     owner: dict[fx.Node, str | None]) -> list[fx.Node]:
    """Tensor-valued nodes made outside layer ``fqn`` that nodes of the layer read, in order."""
    seen: dict[fx.Node, None] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if owner.get(arg) != fqn and arg.op != "get_attr":
                seen.setdefault(arg, None)
    return list(seen)


def _entering(inputs: list[fx.Node], prev: str | None, owner: dict[fx.Node, str | None],
              shape: str | None, order: dict[fx.Node, int]) -> fx.Node | None:
    """Pick the residual stream among a layer's inputs: the last value the previous layer made
    with the stream's shape, else (first layer) a value from outside every layer with that shape."""
    from_prev = [n for n in inputs if prev is not None and owner.get(n) == prev]
    if shape is not None:
        from_prev = [n for n in from_prev if _shape_key(n) == shape]
    if from_prev:
        return max(from_prev, key=order.__getitem__)
    free = [n for n in inputs if owner.get(n) is None and _shape_key(n) is not None
            and not _computed_in_backward(n)]
    if shape is not None:
        free = [n for n in free if _shape_key(n) == shape]
    return free[0] if free else None


def _computed_in_backward(node: fx.Node) -> bool:
    """A gradient (e.g. the residual stream's accumulated grad), never a saved layer input:
    ``autograd_backward`` (torch 2.13) or ``partitioner_tag="is_backward"`` (2.11 too)."""
    meta = node.meta
    return bool(meta.get("autograd_backward")) or meta.get("partitioner_tag") == "is_backward"


def _stream_shape(found: list, owner: dict[fx.Node, str | None]) -> str | None:
    """The shape every layer receives from the one before it (the residual stream's)."""
    votes: collections.Counter[str] = collections.Counter()
    for (prev, _, _), (_, _, ins) in zip(found, found[1:], strict=False):  # consecutive pairs
        votes.update({_shape_key(n) for n in ins if owner.get(n) == prev} - {None})
    return votes.most_common(1)[0][0] if votes else None


@dataclasses.dataclass
class _Layer:
    """A layer as the passes see it: the boundary plus its node objects."""

    boundary: LayerBoundary
    input: fx.Node | None
    members: list[fx.Node]


def _check_graph_module(gm: object, api: str) -> None:
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(
            f"swap_pass.{api}: expected a torch.fx.GraphModule, got {type(gm).__name__}. "
            "Trace the model first (torch.fx.symbolic_trace, torch.export(...).module(), or a "
            "Dynamo backend's gm)."
        )


def find_layers(gm: fx.GraphModule, layer_filter: LayerFilter = None,
                api: str = "find_layer_boundaries", *, strict: bool = True) -> list[_Layer]:
    """Like :func:`find_layer_boundaries`, also returning the nodes (for the passes).

    ``strict=False`` (the compile path): a ``layer_filter`` matching nothing gives no layers, not
    an error: only some of the graphs Dynamo splits a model into hold layers (not HF's loss).
    """
    _check_graph_module(gm, api)
    modules = _all_modules(gm)
    if isinstance(layer_filter, ModuleFiltered):
        narrowed = layer_filter
        fqns = [f for f in _select_layers(modules, narrowed.layer_filter) if narrowed.keeps(gm, f)]
    else:
        fqns = _select_layers(modules, layer_filter)
    if not fqns and layer_filter is not None and not strict:
        log.debug("swap_pass.%s: layer_filter=%r matches none of this graph's modules %s",
                  api, layer_filter, sorted(modules)[:6])
    elif not fqns and layer_filter is not None:
        raise ValueError(
            f"swap_pass.{api}: layer_filter={layer_filter!r} matched none of the graph's "
            f"{len(modules)} modules (e.g. {sorted(modules)[:6]}). It must match at least one "
            "module name (re.fullmatch) or class."
        )
    wanted = set(fqns)
    owner = {n: _layer_of(gm, n, wanted) for n in gm.graph.nodes}
    found = []
    for fqn in fqns:
        members = [n for n in gm.graph.nodes if owner[n] == fqn and n.op != "placeholder"]
        if members:
            found.append((fqn, members, _external_inputs(members, fqn, owner)))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = _pick_inputs(found, owner, order)
    return [_make_layer(i, fqn, modules[fqn], node, members)
            for i, ((fqn, members, _), node) in enumerate(zip(found, inputs, strict=True))]


def _pick_inputs(found: list, owner: dict[fx.Node, str | None],
                 order: dict[fx.Node, int]) -> list[fx.Node | None]:
    """The entering node of each layer."""
    shape = _stream_shape(found, owner)
    picks = []
    for i, (_, members, ins) in enumerate(found):
        pick = _entering(ins, found[i - 1][0] if i else None, owner, shape, order)
        if pick is None and shape is None and members[0].op == "call_module":
            pick = next((a for a in members[0].args if isinstance(a, fx.Node)), None)
        elif pick is None and shape is None and ins:
            pick = ins[0]  # no shape information anywhere (plain symbolic_trace)
        picks.append(pick)
    return picks


def _make_layer(index: int, fqn: str, cls: object, node: fx.Node | None,
                members: list[fx.Node]) -> _Layer:
    boundary = LayerBoundary(index, fqn, _type_name(cls), node.name if node is not None else None,
                             members[0].name, members[-1].name)
    return _Layer(boundary, node, members)


def find_layer_boundaries(gm: fx.GraphModule, *,
                          layer_filter: LayerFilter = None) -> list[LayerBoundary]:
    """Return the layers the swap pass will act on, with the node entering each.

    Args:
        gm: A graph from ``torch.fx.symbolic_trace``, Dynamo, ``torch.export`` or AOTAutograd.
        layer_filter: Which modules are the layers: a regex that must ``re.fullmatch`` the module
            name (``r"model\\.layers\\.\\d+"``), a class or tuple of classes, or a callable
            ``(fqn, cls) -> bool``. ``None`` picks the outermost family of same-class blocks
            under one parent (Note: [The layer family rule] in ``swap_pass/layer_family.py``),
            as ``enable_swap_layer_input`` does. Default: ``None``.

    Returns:
        One :class:`LayerBoundary` per layer, in layer order (printable).

    Raises:
        TypeError: ``gm`` is not a ``torch.fx.GraphModule``.
        ValueError: ``layer_filter`` matches no module of the graph.
    """
    return [layer.boundary for layer in find_layers(gm, layer_filter)]
