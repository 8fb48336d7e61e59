"""Reading a layer call: where its ``hidden_states`` is, which outputs carry gradients.

A layer call looks like ``layer(hidden_states, *rest, **kw)`` or ``layer(..., hidden_states=x)``
(MindSpeed's convention: the ``hidden_states`` kwarg first, else ``args[0]``). A layer returns a
tensor, a tuple/list whose items include tensors (Megatron returns ``(hidden_states, context)``),
or a mapping (HF ``ModelOutput``). Everything else is passed through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_device", "find_hidden_states", "grad_outputs", "in_backward"]


def find_hidden_states(args: tuple, kwargs: dict, api: str) -> torch.Tensor:
    """Return the layer input: ``kwargs["hidden_states"]``, else ``args[0]``.

    Raises:
        ValueError: Neither is present.
        TypeError: The value found is not a tensor.
    """
    if "hidden_states" in kwargs:
        value, where = kwargs["hidden_states"], "kwargs['hidden_states']"
    elif args:
        value, where = args[0], "args[0]"
    else:
        raise ValueError(
            f"swap_pass.{api}: the layer was called without hidden_states (args=(), "
            f"kwargs={sorted(kwargs)}). Pass the layer input as the 'hidden_states' keyword or "
            "as the first positional argument."
        )
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"swap_pass.{api}: hidden_states ({where}) is a {type(value).__name__}, not a "
            "torch.Tensor. The layer input to swap must be a tensor."
        )
    return value


def _first_parameter(module: torch.nn.Module) -> torch.nn.Parameter | None:
    """``next(module.parameters(), None)`` without building the generators (once per layer call).

    Same order as ``Module.parameters()``: the module's own, then its children's, depth first.
    """
    for param in module._parameters.values():
        if param is not None:
            return param
    for child in module._modules.values():
        if child is not None:
            param = _first_parameter(child)
            if param is not None:
                return param
    return None


def check_device(layer: torch.nn.Module, hidden_states: torch.Tensor, api: str,
                 known: torch.nn.Parameter | None = None) -> torch.nn.Parameter | None:
    """Raise when ``hidden_states`` is on another device than the layer's parameters.

    Args:
        layer: The layer about to run.
        hidden_states: Its input.
        api: Named in the error.
        known: What the previous call returned: a parameter on the input's device passes
            without walking the layer's modules again (``model.to()`` moves a parameter in
            place, so it stays the layer's). Default: ``None``.

    Returns:
        The layer's first parameter (None when it has none), for the next call's ``known``.
    """
    if known is not None and known.device == hidden_states.device:
        return known
    param = _first_parameter(layer)
    if param is not None and param.device != hidden_states.device:
        raise ValueError(
            f"swap_pass.{api}: hidden_states is on {hidden_states.device} but "
            f"{type(layer).__name__}'s parameters are on {param.device}. The layer input must be "
            "on the layer's device."
        )
    return param


def _tensors_in(result: Any) -> list[torch.Tensor] | None:
    """Tensors directly inside ``result`` (one level), or None for an unknown type."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    if isinstance(result, Mapping):
        return [t for t in result.values() if isinstance(t, torch.Tensor)]
    return None


def grad_outputs(result: Any, api: str) -> list[torch.Tensor]:
    """The outputs of a layer call that require grad (where backward of the layer starts).

    Raises:
        TypeError: Under grad mode, ``result`` is neither a tensor, a tuple/list nor a mapping,
            so the start of the layer's backward cannot be found.
    """
    if type(result) is torch.Tensor:  # the common case, answered without building a list twice
        return [result] if result.requires_grad else []
    tensors = _tensors_in(result)
    if tensors is None:
        if torch.is_grad_enabled():
            raise TypeError(
                f"swap_pass.{api}: the layer returned a {type(result).__name__}. A swapped layer "
                "must return a tensor, a tuple/list of tensors and other values, or a mapping."
            )
        return []
    return [t for t in tensors if t.requires_grad]


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (recomputation)."""
    return torch._C._current_graph_task_id() != -1
