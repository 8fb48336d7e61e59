"""MindSpeed's decorators: swap each Transformer layer's input in MindSpeed-style layer code.

Usage (Megatron / MindSpeed style; both decorators, in this order of construction then call)::

    class TransformerLayer(nn.Module):
        @swap_layer_input_init_wrapper
        def __init__(self, ...): ...

        @swap_layer_input_forward_wrapper
        def forward(self, hidden_states, ...): ...

FBOverlap schedules decorate their free functions instead (MindSpeed's call conventions):

* ``swap_layer_input_fboverlap_forward_wrapper`` on ``transformer_layer_forward(layer,
  hidden_states, ..., checkpoint=...)``: with ``checkpoint=True`` the layer input goes to the
  host while the layer runs and its device storage is freed right after.
* ``swap_layer_input_fboverlap_1f1b_wrapper`` on the fused ``forward_backward_overlaping(
  fwd_layer, hidden_states, attention_mask, bwd_layer_output_grad, bwd_layer_graph, ...)``.
* ``swap_layer_input_fboverlap_backward_wrapper`` on ``transformer_layer_backward(
  layer_output_grad, layer_graph)``; ``layer_graph.layer`` holds the manager.

See ``swap_pass/eager/_protocol.py`` for the protocol and ``docs/eager.md`` for the rationale.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from swap_pass.eager import _protocol
from swap_pass.eager._protocol import _tensors_in, find_hidden_states
from swap_pass.runtime.chain import (
    SwapLayerInputManager,
    chain_of_tag,
    free_if_unheld,
    prefetch_ahead,
    restore_for_backward,
)
from swap_pass.runtime.freeing import autograd_mark, in_backward
from swap_pass.runtime.group import HOST, SwapTensors

__all__ = [
    "swap_layer_input_fboverlap_1f1b_wrapper",
    "swap_layer_input_fboverlap_backward_wrapper",
    "swap_layer_input_fboverlap_forward_wrapper",
    "swap_layer_input_forward_wrapper",
    "swap_layer_input_init_wrapper",
]

INIT_MARK = "_swap_pass_init_done"
_DEPTH = "_swap_pass_init_depth"


# --- construction ---------------------------------------------------------------------------


def _is_mtp(layer: object) -> bool:
    return bool(getattr(layer, "is_mtp_layer", getattr(layer, "is_mtp", False)))


def _register_manager(layer: torch.nn.Module) -> None:
    """Give ``layer`` its manager once construction is complete; MTP layers get none."""
    object.__setattr__(layer, INIT_MARK, True)
    if _is_mtp(layer):
        manager = layer.__dict__.pop("swap_manager", None)
        if manager is not None:  # made by an inner __init__ before is_mtp was set
            manager.unregister()
        return
    if "swap_manager" not in layer.__dict__:
        chain = chain_of_tag(getattr(layer, "swap_module_tag", "default"))
        object.__setattr__(layer, "swap_manager", SwapLayerInputManager(chain=chain))


def swap_layer_input_init_wrapper(fn: Callable[..., None]) -> Callable[..., None]:
    """Decorate a layer's ``__init__``: register one :class:`SwapLayerInputManager` per instance.

    Managers are numbered in construction order in the chain of ``self.swap_module_tag`` (class
    or instance attribute; Default: ``"default"``): one chain per tag, kept until
    :func:`swap_pass.reset`. Layers marked ``is_mtp`` / ``is_mtp_layer``
    get no manager and leave no entry. Nested decorated ``__init__`` calls (a subclass calling
    ``super().__init__``) register once, after the outermost one returns.
    """

    @functools.wraps(fn)
    def wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        depth = self.__dict__.get(_DEPTH, 0)
        object.__setattr__(self, _DEPTH, depth + 1)
        try:
            fn(self, *args, **kwargs)
        finally:
            if depth:
                object.__setattr__(self, _DEPTH, depth)
            else:
                del self.__dict__[_DEPTH]
        if depth == 0:
            _register_manager(self)

    return wrapper


# --- standard forward -----------------------------------------------------------------------


def swap_layer_input_forward_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a layer's ``forward``: swap its ``hidden_states`` input between layers.

    When the layer is entered, its input's device-to-host copy starts (not for the last layer);
    after the layer ran, the previous layer's input is freed; a gradient hook on the outputs
    waits for the input's host-to-device copy before any backward reader and prefetches the
    previous layer's input.
    Layers without a manager (MTP layers) run unchanged.

    Raises:
        RuntimeError: The instance was not built through ``swap_layer_input_init_wrapper``.
    """
    api = "swap_layer_input_forward_wrapper"

    @functools.wraps(fn)
    def wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if "swap_manager" not in self.__dict__:
            if not self.__dict__.get(INIT_MARK, False):
                raise RuntimeError(
                    f"swap_pass.{api}: {type(self).__name__}.forward is wrapped but its instance "
                    "has no swap manager and its __init__ was not wrapped. Decorate __init__ with "
                    "swap_layer_input_init_wrapper too (or use enable_swap_layer_input)."
                )
            return fn(self, *args, **kwargs)
        return _protocol.run_layer(self, functools.partial(fn, self), args, kwargs, api)

    return wrapper


# --- FBOverlap ------------------------------------------------------------------------------


def _manager_of(layer: object) -> SwapLayerInputManager | None:
    manager = getattr(layer, "swap_manager", None)
    if manager is not None:
        manager.ensure_registered()  # after swap_pass.reset()
    return manager


def _group_of(manager: SwapLayerInputManager, tensor: torch.Tensor | None) -> SwapTensors | None:
    """The in-flight group of ``manager`` holding ``tensor``'s storage (FIFO head if no tensor)."""
    if tensor is None:
        return manager.batch_stack[0] if manager.batch_stack else None
    key = tensor.untyped_storage()._cdata
    for group in manager.batch_stack:
        if any(t.untyped_storage()._cdata == key for t in group.tensors):
            return group
    return None  # this input was never swapped (e.g. the last layer)


def _restore_for_backward(manager: SwapLayerInputManager, layer_input: torch.Tensor | None) -> None:
    """Make this layer's input readable, then prefetch the previous layer's oldest group on the
    host (FBOverlap bwd; the steps: ``swap_pass/runtime/chain.py``)."""
    group = _group_of(manager, layer_input)
    if group is not None:
        restore_for_backward(group, manager.batch_stack,
                             "swap_layer_input_fboverlap_backward_wrapper")
    prev = manager.previous
    if prev is not None and prev.prefetch_enabled:
        oldest = next((g for g in prev.batch_stack if g.stat is HOST), None)
        prefetch_ahead((oldest,), prev.config)


def _start_swap_out(manager: SwapLayerInputManager,
                    hidden_states: torch.Tensor) -> SwapTensors | None:
    if manager.is_last_layer or in_backward():
        return None
    # The layer has not run yet: its entry. FBOverlap detaches every layer input itself.
    claimed = manager.claim([hidden_states], leaves_owned=True)
    if not claimed:
        return None
    group = manager.swap_out(claimed, copy_span=True)
    group.entry_mark = autograd_mark()
    return group


def _layer_graph_in(result: Any) -> Any:
    """The ``LayerGraph`` (an object with ``.layer`` and ``.layer_input``) returned in
    ``result``."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return next((item for item in items if hasattr(item, "layer") and hasattr(item, "layer_input")),
                None)


def _tie_to_layer_graph(result: Any, manager: SwapLayerInputManager, group: SwapTensors) -> None:
    """Discard ``group`` when the ``LayerGraph`` returned with ``result`` is freed unused."""
    item = _layer_graph_in(result)
    if item is not None:
        try:
            weakref.finalize(item, _protocol.discard_if_pending, manager, group)
        except TypeError:  # a LayerGraph with __slots__ and no __weakref__: no tie
            pass


def _finish_swap_out(manager: SwapLayerInputManager, group: SwapTensors | None,
                     result: Any) -> None:
    if group is not None:
        roots = _tensors_in(result) or []
        graph = _layer_graph_in(result)
        accounted = ([graph.layer_input]
                     if isinstance(getattr(graph, "layer_input", None), torch.Tensor) else [])
        if not free_if_unheld(group, manager.name, roots, accounted=accounted):
            manager.keep_on_device(group)  # another holder is left
            return
        _tie_to_layer_graph(result, manager, group)


def _run_fwd(manager: SwapLayerInputManager, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except BaseException:
        _protocol.abort_chain(manager.chain)
        raise


def swap_layer_input_fboverlap_forward_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate FBOverlap's ``transformer_layer_forward(layer, hidden_states, ..., checkpoint=)``.

    With ``checkpoint=True`` (the layer keeps only its input) the input's D2H runs alongside
    the layer and its device storage is freed when the layer returns. Otherwise unchanged.
    """
    api = "swap_layer_input_fboverlap_forward_wrapper"

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = _manager_of(self)
        if manager is None or not kwargs.get("checkpoint", False):
            return fn(self, *args, **kwargs)
        group = _start_swap_out(manager, find_hidden_states(args, kwargs, api))
        result = _run_fwd(manager, lambda: fn(self, *args, **kwargs))
        _finish_swap_out(manager, group, result)
        return result

    return wrapper


def _bwd_layer_graph(args: tuple, kwargs: dict) -> Any:
    graph = kwargs.get("bwd_layer_graph")
    if graph is None and len(args) > 3 and hasattr(args[3], "layer"):
        graph = args[3]
    return graph


def swap_layer_input_fboverlap_1f1b_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the fused ``forward_backward_overlaping(fwd_layer, hidden_states, attention_mask,
    bwd_layer_output_grad, bwd_layer_graph, ...)``.

    Starts the forward layer's input D2H, makes the backward layer's input readable (before its
    recomputation) and prefetches the layer before it, runs both, then frees the forward input.

    Raises:
        ValueError: ``bwd_layer_graph`` (kwarg or ``args[3]``) is missing or its layer has no
            manager.
    """
    api = "swap_layer_input_fboverlap_1f1b_wrapper"

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = _manager_of(self)
        if manager is None:
            return fn(self, *args, **kwargs)
        hidden_states = find_hidden_states(args, kwargs, api)
        graph = _bwd_layer_graph(args, kwargs)
        bwd_manager = _manager_of(getattr(graph, "layer", None))
        if bwd_manager is None:
            raise ValueError(
                f"swap_pass.{api}: no backward LayerGraph with a swap manager (bwd_layer_graph="
                f"{type(graph).__name__}). Pass bwd_layer_graph (kwarg or args[3]) whose .layer "
                "was built with swap_layer_input_init_wrapper."
            )
        group = _start_swap_out(manager, hidden_states)
        _restore_for_backward(bwd_manager, getattr(graph, "layer_input", None))
        result = _run_fwd(manager, lambda: fn(self, *args, **kwargs))
        _finish_swap_out(manager, group, result)
        return result

    return wrapper


def swap_layer_input_fboverlap_backward_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate FBOverlap's ``transformer_layer_backward(layer_output_grad, layer_graph)``.

    Waits for the layer's input to be back on the device *before* the call (it recomputes from
    that input) and prefetches the previous layer's input. ``args[1].layer`` holds the manager.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        graph = args[1] if len(args) > 1 else kwargs.get("layer_graph")
        manager = _manager_of(getattr(graph, "layer", None))
        if manager is not None:
            _restore_for_backward(manager, getattr(graph, "layer_input", None))
        return fn(*args, **kwargs)

    return wrapper
