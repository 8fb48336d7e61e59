"""Which modules are "the layers": one rule for the eager, traced and compiled paths.

The layers are the outermost family of repeated blocks, the modules that carry the residual
stream from one to the next::

    model.layers.0, model.layers.1, ...          # ModuleList: a family (HF, nn.TransformerEncoder)
    layers["0"], layers["1"], ...                # ModuleDict keys, any strings (torchtitan)
    model.block_a, model.block_b                 # named attributes of one class
    model.layers.0.mlp.experts.0, ...            # inside a member of a family: not layers
    model.mlp.0, model.mlp.2 (nn.Linear)         # no submodules, not in a ModuleList: not layers

Note: [The layer family rule]
A *family* is two or more sibling modules (one parent, any child names) of one class, each of
which has submodules of its own, or whose parent is an ``nn.ModuleList``/``nn.ModuleDict`` (a
list of blocks said explicitly): a Transformer block holds attention and MLP modules, while the
Linear modules of an ``nn.Sequential`` MLP, or the q/k/v projections of an attention, hold none.
A family nested inside a member of another family (MoE experts inside a decoder layer, the
Linear modules of a block's MLP) is never chosen: the outer family's blocks are the ones whose
inputs are the residual stream, and each of them saves the inner ones' inputs by itself. Among
the outermost families the largest wins; ties go to the shallowest, then to the first one met.
The eager finder applies this rule to ``model.named_modules()``; the graph passes apply it to the
modules a graph's nodes ran in (``nn_module_stack``), so ``enable_swap_layer_input``,
``find_layer_boundaries``, ``apply_swap_pass``, ``swap_backend`` and ``compile_layers`` pick the
same blocks of the same model.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["choose_layer_family"]


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


_CONTAINERS = ("ModuleList", "ModuleDict")


def _families(modules: dict[str, str], has_children: set[str]) -> list[list[str]]:
    """Sibling modules of one class, two or more, in ``modules`` order, that hold submodules or
    sit in a ``ModuleList``/``ModuleDict`` (an explicit list of blocks)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for fqn, cls in modules.items():
        if fqn and (fqn in has_children or modules.get(_parent(fqn)) in _CONTAINERS):
            groups.setdefault((_parent(fqn), cls), []).append(fqn)
    return [members for members in groups.values() if len(members) >= 2]


def _inside(fqn: str, members: Iterable[str]) -> bool:
    return any(fqn.startswith(m + ".") for m in members)


def choose_layer_family(modules: dict[str, str]) -> list[str]:
    """The layers among ``modules`` (Note: [The layer family rule]), in ``modules`` order.

    Args:
        modules: Every module's qualified name mapped to its class name, in the order the model
            registers or runs them (``""`` is the root). A module counts as holding submodules
            when another name in ``modules`` starts with its name and a dot.

    Returns:
        The chosen family's names, or ``[]`` when no family exists.
    """
    has_children = {_parent(fqn) for fqn in modules if fqn}
    families = _families(modules, has_children)
    every = [m for f in families for m in f]
    outer = [f for f in families if not _inside(f[0], every)]
    if not outer:
        return []
    depth = {id(f): f[0].count(".") for f in outer}
    return max(outer, key=lambda f: (len(f), -depth[id(f)], -outer.index(f)))
