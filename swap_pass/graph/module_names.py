"""Module names in graphs Dynamo compiled from a frame it resumed after a graph break.

Note: [Module names in resumed frames]
Dynamo records every module a node ran in under the expression the frame reached it through
(``meta["nn_module_stack"]`` values ``(path, class)``): ``L['self'].layers[2]`` in ``forward``.
In a frame resumed after a graph break, a layer reached through a local variable held across the
break is recorded under that variable: ``L['layers'][3]`` after ``layers = list(self.layers)``,
``L['layer']`` for a loop variable, ``L['blocks'].2`` for a local ``ModuleList``.
``normalize_fqn`` drops the local's name with the frame's root, so such layers would all be
called ``""``: no ``layer_filter`` (a regex like ``layers\\.\\d+``) could name or tell them apart.

Before partitioning, the backend resolves each path not starting at a top module of the frame
(one no other local module holds: ``self``, not a local ``ModuleList`` taken from it) against the
frame's locals, by ``getattr`` and ``[]`` steps on modules and lists only (no other code runs),
looks the module up among those the top modules hold, and records the path as
``L['<that local>'].<qualified name>``, the model's own name for the layer; else the recorded
name stays. The locals come from Dynamo's translator of the frame being compiled
(``InstructionTranslator.current_tx().f_locals``, checked on torch 2.13.0, 2.14.1 and 2.15.0);
without one, or outside a Dynamo compile, nothing changes.
"""

from __future__ import annotations

import re
from typing import Any

from torch import fx, nn

__all__ = ["name_modules_as_the_model_does"]

_ROOT = re.compile(r"L\['([^']+)'\]")
_STEP = re.compile(r"\.(_modules|_parameters|_buffers)\['([^']+)'\]|\[(\d+)\]|\['([^']+)'\]"
                   r"|\.(\w+)")
_UNRESOLVED = object()


def _frame_locals() -> dict[str, Any] | None:
    """The locals of the frame Dynamo is compiling now, or None outside a Dynamo compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        f_locals = getattr(InstructionTranslator.current_tx(), "f_locals", None)
    except (ImportError, AttributeError):
        return None
    return f_locals if isinstance(f_locals, dict) else None


def _step(obj: Any, match: re.Match) -> Any:
    container, key, index, item, attr = match.groups()
    if container is not None:
        return getattr(obj, container)[key]
    if index is not None:
        return obj[int(index)]
    if item is not None:
        return obj[item]
    return getattr(obj, attr)


def _resolve(path: str, f_locals: dict[str, Any]) -> Any:
    """The object ``path`` (``L['name']`` and attribute/index steps) names, or ``_UNRESOLVED``."""
    head = _ROOT.match(path)
    if head is None or head.group(1) not in f_locals:
        return _UNRESOLVED
    obj, pos = f_locals[head.group(1)], head.end()
    while pos < len(path):
        match = _STEP.match(path, pos)
        if match is None:
            return _UNRESOLVED
        try:
            obj = _step(obj, match)
        except (AttributeError, KeyError, IndexError, TypeError):
            return _UNRESOLVED
        pos = match.end()
    return obj


def _top_modules(f_locals: dict[str, Any]) -> dict[str, nn.Module]:
    """The frame's local modules that no other local module holds (the model, ``self``); a local
    ``ModuleList`` taken from the model is not one of them."""
    local = {name: v for name, v in f_locals.items() if isinstance(v, nn.Module)}
    inner = {id(m) for v in local.values() for _, m in v.named_modules() if m is not v}
    return {name: v for name, v in local.items() if id(v) not in inner}


def _held_modules(tops: dict[str, nn.Module]) -> dict[int, str]:
    """``id(module)`` -> ``L['<local>'].<qualified name>`` for every module under a top module of
    the frame; the first local holding a module names it."""
    names: dict[int, str] = {}
    for local, value in tops.items():
        for qualname, module in value.named_modules():
            names.setdefault(id(module), f"L['{local}']" + (f".{qualname}" if qualname else ""))
    return names


def _renamed(path: str, f_locals: dict[str, Any], tops: dict[str, nn.Module],
             held: dict[int, str]) -> str:
    head = _ROOT.match(path)
    if head is not None and head.group(1) in tops:
        return path  # reached from the model the frame holds: already its qualified name
    module = _resolve(path, f_locals)
    if not isinstance(module, nn.Module):
        return path
    return held.get(id(module), path)


def name_modules_as_the_model_does(gm: fx.GraphModule) -> int:
    """Rename the ``nn_module_stack`` paths that reach a module through a local variable to its
    qualified name in the model (Note: [Module names in resumed frames]).

    Returns:
        How many distinct paths were renamed (0 outside a Dynamo compile).
    """
    f_locals = _frame_locals()
    if not f_locals:
        return 0
    tops = _top_modules(f_locals)
    held, cache = _held_modules(tops), {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        for path, _ in stack.values():
            if path not in cache:
                cache[path] = _renamed(path, f_locals, tops, held)
        if any(cache[path] != path for path, _ in stack.values()):
            node.meta["nn_module_stack"] = {key: (cache[path], cls)
                                            for key, (path, cls) in stack.items()}
    return sum(new != old for old, new in cache.items())
