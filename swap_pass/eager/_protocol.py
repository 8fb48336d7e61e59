"""The SwapLayerInput protocol for one layer call, shared by the decorators and ``enable``.

Its steps (free after the next layer, restore before backward) are the runtime's, in
``swap_pass/runtime/chain.py``; this module decides where each runs in an eager layer call.

Graph pattern (layer ``i`` of ``L``, one micro-batch)::

    forward:  x_i -> layer_i -> out_i
                     at its entry: group_i = swap_out(x_i)         (not for the last layer)
                     after it ran: free(groups of layer i-1 in "d2h" that are guarded)
    backward: grad(out_i) -> [guard_i: restore(group_i); restore(group_{i-1});
                              prefetch(group_{i-2})] -> layer_i backward

Note: [Guard before the first reader]
    The guard is a gradient hook on the layer's outputs. A tensor hook on a non-leaf runs as a
    pre-hook of its ``grad_fn``, and every backward node of the layer (and the recomputation of
    a checkpointed layer, which is triggered by those nodes or *is* that ``grad_fn``) runs after
    it. So the host-to-device copy is waited for before anything reads ``x_i``. MindSpeed waits
    in a hook on the *recomputed* output, after the recompute already read the input: a race.

Note: [Readers outside the layer]
    Layer ``i``'s own backward is not the first to read ``x_i``. An op outside the layer that
    read ``x_i`` after it ran (``alpha * x_i``, a head on an intermediate hidden state), or the
    recomputation of a checkpoint around layers ``i`` and ``i+1``, has an autograd node created
    between layer ``i`` and layer ``i+1``: it runs after layer ``i+1``'s backward nodes and
    before layer ``i``'s guard, and C++ kernels pass no Python guard. So layer ``i+1``'s guard
    already makes ``x_i`` readable (the compute stream waits for its copy) and prefetches
    ``x_{i-1}`` one layer further ahead; the copy of ``x_i`` overlapped layer ``i+2``'s
    backward. The price: one more layer input on the device during backward. Python readers
    further back (a checkpoint around three or more layers) restore the data when they read it
    (see Note: [Guarding freed tensors]).

Note: [No-grad first forward]
    Under reentrant checkpointing (and Megatron's ``CheckpointFunction``) the layer runs under
    ``no_grad``: its outputs carry no graph to hook. Its input ``x_i`` still requires grad. Its
    group is guarded by the *next* layer call, whose input is this layer's checkpoint output:
    a hook on it runs before this layer's ``CheckpointFunctionBackward`` (the recompute). A
    group that no call could guard is never freed; it is abandoned (data stays on device). A
    reentrant segment of several layers checkpoints as one: its inner layers' inputs need no
    grad and are never copied; its first layer's group is guarded by the next segment's first
    call (whose input is this segment's output); the last segment's, which nothing can guard, is
    abandoned once the last layer has run, so no host buffer outlives the step.

Note: [Grad mode at layer entry]
    Whether a call is a no-grad first forward is read from the grad mode when the layer is
    *entered*, never from its outputs: a layer may re-enable grad inside (Megatron's
    ``TransformerLayer`` runs its bias-dropout-add under ``torch.enable_grad``), so inside
    ``CheckpointFunction``'s ``no_grad`` forward its output still requires grad. That output's
    graph is thrown away when the checkpoint gives its result a new ``grad_fn``: a guard hooked
    on it would never fire and the recompute would read the freed input. For the same reason a
    no-grad call's raw output is marked: a later layer that receives it as input runs inside the
    same checkpointed region (``recompute_num_layers > 1``), nothing keeps that input for backward,
    and its ``grad_fn`` is no place for a guard. Only a tensor that left the region (the
    checkpoint's own output, with its ``grad_fn``) can guard, whatever the grad mode of the
    layer that receives it (Megatron's ``block`` recompute: checkpointed layers, then plain ones).

Note: [Group lifetime]
    Each guard holds its group in its closure (pairing each backward with its own forward under
    gradient accumulation, partial backward and pipeline schedules); ``batch_stack`` stays the
    FIFO the prefetch walks. The guard lives in the autograd graph; its ``__del__`` discards
    the group when the graph is freed without a backward (eval with grad, dropped loss), so no
    entry or host byte outlives its graph. (A ``__del__`` costs nothing until it runs; a
    ``weakref.finalize`` per layer call cost more than the restore it guards.) Once the guard
    has restored its group it lets go of it: the guard itself lives until the loss is dropped,
    and holding the group would keep every restored input alive to the end of backward
    (tests/eager/test_backward_release.py).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from swap_pass.config import SwapConfig
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime import stats
from swap_pass.runtime.chain import (
    LayerChain,
    SwapLayerInputManager,
    free_if_unheld,
    prefetch_ahead,
    restore_for_backward,
)
from swap_pass.runtime.device import entry_compute_stream
from swap_pass.runtime.freeing import autograd_mark
from swap_pass.runtime.group import DEVICE, H2D, HOST, SwapTensors, no_group
from swap_pass.state import warn_once

__all__ = ["BackwardGuard", "abort_chain", "check_device", "discard_if_pending",
           "find_hidden_states", "grad_outputs", "run_layer"]


# --- Reading a layer call: where its ``hidden_states`` is, which outputs carry gradients ----------
# A layer call looks like ``layer(hidden_states, *rest, **kw)`` or ``layer(..., hidden_states=x)``
# (MindSpeed's convention: the ``hidden_states`` kwarg first, else ``args[0]``). A layer returns a
# tensor, a tuple/list whose items include tensors (Megatron returns ``(hidden_states, context)``),
# or a mapping (HF ``ModelOutput``). Everything else is passed through untouched.


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


# --------------------------------------------------------------------------------------------------


_REGION_OUTPUT_ATTR = "_swap_pass_no_grad_output"
_graph_task_id = torch._C._current_graph_task_id  # -1 outside backward; see in_backward()


# --- guards ---------------------------------------------------------------------------------


class BackwardGuard:
    """Gradient hook that makes one group and the previous layer's readable, and prefetches.

    Args:
        manager: The manager that owns ``group``.
        group: The layer input group to restore, or None (the last layer: prefetch only).
        previous: The previous layer's group of the same micro-batch, when ``group`` is None.
            Default: ``None`` (the one linked to ``group``).
    """

    __slots__ = ("manager", "group", "fired", "_previous")  # one per layer call: no instance dict

    def __init__(self, manager: SwapLayerInputManager, group: SwapTensors | None,
                 previous: SwapTensors | None = None) -> None:
        self.manager = manager
        self.group = group
        self.fired = False
        if group is not None:
            self._previous = group.previous_link
            group.guarded = True
        else:
            self._previous = _weak(previous)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # The graph is gone: a group never restored was not read by a backward (Note: [Group
        # lifetime]). At interpreter exit nothing will read it again either.
        group = getattr(self, "group", None)
        if group is not None and not _finalizing():
            discard_if_pending(self.manager, group)

    def __call__(self, grad: torch.Tensor) -> None:
        group = self.group
        if group is not None:
            restore_for_backward(group, self.manager.batch_stack, "BackwardGuard")
            self.group = None  # let go of it: see Note: [Group lifetime]
        if not self.fired:
            self.fired = True
            self._ready_previous()
        return None

    def _ready_previous(self) -> None:
        """Ready the previous layer's input, prefetch the one before it (same micro-batch).

        See Note: [Readers outside the layer].
        """
        prev, group = self.manager.previous, self._previous()
        if prev is None or group is None:
            return
        if group.stat is H2D or group.stat is HOST:
            prev.wait_swap_in(group)
        prefetch_ahead(_same_micro_batch(prev.previous, group.previous_link()),
                       self.manager.config)

    def attach(self, tensors: list[torch.Tensor]) -> None:
        """Register the guard on each tensor (idempotent: the first gradient to arrive wins)."""
        for t in tensors:
            _add_grad_hook(t, self)


def _same_micro_batch(manager: SwapLayerInputManager | None,
                      group: SwapTensors | None) -> Iterator[SwapTensors]:
    """``group`` (``manager``'s) and the groups before it in the same micro-batch, nearest
    first, while their managers prefetch."""
    while manager is not None and group is not None and manager.prefetch_enabled:
        yield group
        manager, group = manager.previous, group.previous_link()


def _wait_oldest_copies(earlier: list[tuple[SwapLayerInputManager, SwapTensors]],
                        config: SwapConfig) -> None:
    """Before a new device-to-host copy: wait for the oldest of ``earlier`` (still copying out,
    nearest layer first) until fewer than ``SwapConfig.max_copies_in_flight`` are left."""
    limit = config.max_copies_in_flight
    if limit is None or len(earlier) < limit:
        return
    for _, group in earlier[limit - 1:]:
        group.wait_copy_out()


_HOOK_KEYS = itertools.count()


def _add_grad_hook(t: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``t.register_hook(hook)`` without the removable handle, which a guard never uses.

    A tensor's gradient hooks live in ``t._backward_hooks``, the dict that ``register_hook``
    creates and hands to ``t.grad_fn`` once; the engine runs its values in insertion order, so
    the hook runs exactly where ``register_hook`` would put it. Skipping the handle halves the
    cost of hooking a layer's output. The keys are tuples, so they never collide with the
    handles' integer ids. A leaf or a tensor subclass takes the public path.
    """
    grad_fn = t.grad_fn
    if type(t) is not torch.Tensor or grad_fn is None:
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        grad_fn._register_hook_dict(t)
    hooks[("swap_pass", next(_HOOK_KEYS))] = hook


def _weak(group: SwapTensors | None) -> Callable[[], SwapTensors | None]:
    return weakref.ref(group) if group is not None else no_group


def _in_flight_out(earlier: list[tuple[SwapLayerInputManager, SwapTensors]],
                   manager: SwapLayerInputManager | None) -> SwapTensors | None:
    """``manager``'s group of the micro-batch running now: the newest one still copying out.

    ``earlier`` is a later layer's ``copying_earlier()`` (each layer's groups in micro-batch
    order, so the last match is the newest).
    """
    newest = None
    for prev, group in earlier:
        if prev is manager:
            newest = group
    return newest


def discard_if_pending(manager: SwapLayerInputManager, group: SwapTensors) -> None:
    """Finalizer: the graph holding the guard is gone without a backward (dropped loss, eval
    with grad). Autograd will not read ``group`` again, but whoever passed the tensor in may:
    its data goes back to the device, then the group is forgotten."""
    if group.stat != DEVICE or any(g is group for g in manager.batch_stack):
        manager.keep_on_device(group)


# --- forward-side steps ---------------------------------------------------------------------


def free_previous(earlier: list[tuple[SwapLayerInputManager, SwapTensors]],
                  roots: list[torch.Tensor], abandon: bool = True) -> None:
    """Free earlier layers' inputs whose D2H is running (``earlier``, a manager's
    ``copying_earlier()``) if nothing but autograd holds them (``roots``: where the graph that
    saved them is reached, see :func:`swap_pass.runtime.freeing.may_free`); abandon the
    unguarded ones (if ``abandon``: a later call may still guard them otherwise)."""
    for prev, group in earlier:
        guarded = group.guarded
        if guarded and free_if_unheld(group, prev.name, roots):
            continue
        if guarded or abandon:
            prev.keep_on_device(group)  # cannot be protected, or held elsewhere


def _in_region(hidden_states: torch.Tensor) -> bool:
    """Whether ``hidden_states`` is a no-grad layer call's raw output, its ``grad_fn`` unchanged
    (``autograd.Function.apply`` returns the same tensor object with a new ``grad_fn``)."""
    grad_fn = hidden_states.grad_fn
    marked = getattr(hidden_states, _REGION_OUTPUT_ATTR, None)
    return grad_fn is not None and marked == grad_fn._sequence_nr()


def _left_region(hidden_states: torch.Tensor) -> bool:
    """Whether ``hidden_states`` carries a graph that backward will walk (Note: [Grad mode at
    layer entry]): it has a ``grad_fn`` and is not a no-grad layer call's raw output."""
    return (hidden_states.requires_grad and hidden_states.grad_fn is not None
            and not _in_region(hidden_states))


def abandon_unguarded_earlier(manager: SwapLayerInputManager) -> None:
    """The last layer ran: no later call can guard what is still unguarded; keep it on device.

    Only a chain whose ``maybe_unguarded`` is set looks; the flag is cleared here, when every
    earlier unguarded group is back on the device. (A group that a racing thread's clear hides
    is freed by no one: kept on the device, never read freed.)
    """
    chain = manager.chain
    if not chain.maybe_unguarded:
        return
    for prev, group in manager.copying_earlier():
        if not group.guarded:
            prev.keep_on_device(group)
    chain.maybe_unguarded = False


def guard_previous_on_input(manager: SwapLayerInputManager, hidden_states: torch.Tensor) -> None:
    """Guard earlier layers' unguarded groups on our input (see Note: [No-grad first forward]);
    only an input that left its checkpointed region can guard.

    Under reentrant checkpointing of segments of several layers, our input is the previous
    segment's output and the unguarded groups are the inputs of that segment's first layer.
    """
    if not manager.chain.maybe_unguarded or not _left_region(hidden_states):
        return
    for prev, group in manager.copying_earlier():
        if not group.guarded:
            BackwardGuard(prev, group).attach([hidden_states])


def abandon_own_unguarded(manager: SwapLayerInputManager) -> None:
    """Restore this layer's groups that were never guarded (their next layer never ran)."""
    for group in list(manager.batch_stack):
        if not group.guarded:
            manager.keep_on_device(group)


def abort_chain(chain: LayerChain) -> None:
    """After an exception: bring every group of the chain back to the device and forget it."""
    for manager in chain.managers():
        while manager.batch_stack:
            manager.keep_on_device(manager.batch_stack[0])


# Note: [Never a silent step]
#     Each input a layer keeps that is not swapped is counted by reason where it is decided
#     (``swap_stats().skipped_bytes``), with a warning for the reasons that cost a saving. That
#     still leaves the worst case hard to see: a model enabled for swap whose every step swaps
#     nothing (each layer input user data, a parameter, a subclass without local data, sparse)
#     trains exactly, without error, and saves nothing. So when a chain's last layer runs, the
#     inputs its layers kept for backward but that the claim at their entry refused since the
#     last layer last ran are compared with its layers (all but the last swap): when at most
#     half of them were swapped, one warning per tag names the counts and the reasons recorded
#     so far. Only the refusing path writes the count (``LayerChain.missed``), so a step that
#     swaps every layer pays one attribute read at its last layer. Inputs under
#     ``SwapConfig.min_swap_bytes`` (the user's own threshold) and those host exhaustion or a
#     shared storage kept later are counted by their reason and not here; the last two warn on
#     their own.


def _miss(manager: SwapLayerInputManager) -> None:
    """A layer input backward keeps stayed on the device (Note: [Never a silent step])."""
    manager.chain.missed += 1


def check_step(manager: SwapLayerInputManager) -> None:
    """The chain's last layer ran: warn once if its step swapped at most half of its layers'
    inputs (see Note: [Never a silent step])."""
    chain = manager.chain
    missed, chain.missed = chain.missed, 0
    offered = manager.num_layers - 1
    if not missed or missed * 2 < offered:
        return
    reasons = stats.snapshot().skipped_bytes
    warn_once("step", manager.module_tag, (
        f"swap_pass: {manager.module_tag}: a forward kept {missed} layer input(s) on the device "
        f"that backward needs, of {offered} layers that swap; it swapped "
        f"{max(offered - missed, 0)}. Bytes not swapped so far, by reason "
        f"(swap_stats().skipped_bytes): {reasons or 'none recorded'}. See the reasons in "
        "swap_pass.runtime.stats.SkipReason. (Shown once per model until swap_pass.reset().)"),
        stacklevel=4)


# --- one layer call -------------------------------------------------------------------------


def _mark_region_outputs(result: Any, api: str) -> None:
    for t in grad_outputs(result, api):
        if t.grad_fn is not None:
            setattr(t, _REGION_OUTPUT_ATTR, t.grad_fn._sequence_nr())


def _claim_input(manager: SwapLayerInputManager, hidden_states: torch.Tensor,
                 grad_at_entry: bool) -> list[torch.Tensor]:
    """At the layer's entry: the input, if it is to be swapped and may leave the device."""
    kept = grad_at_entry or (hidden_states.requires_grad and not _in_region(hidden_states))
    if manager.is_last_layer or not kept:
        return []
    return manager.claim([hidden_states])  # see Note: [Ownership rule] in runtime/freeing.py


# Note: [The copy out starts at the layer's entry]
# A layer input's copy to the host starts when the layer is entered, on the d2h stream, while
# the layer's own forward runs; the compute stream waits for it when the input is freed, after
# the next layer ran. Its window is two layers' forward (measured on the test accelerator:
# ``docs/graph.md``, "Copy windows"); starting it when the layer returns gave one, at the same
# memory (the input lives through its own layer anyway). The copy reads the input as it was at
# the entry: when the layer wrote it in place (its version moved on), or nothing keeps it for
# backward after all, the started group goes back to the device and, if the input is kept, a
# new copy starts from what the layer left, as before.


def _start_at_entry(manager: SwapLayerInputManager, claimed: list[torch.Tensor],
                    entry_stream: torch.Stream | None) -> tuple[SwapTensors | None, int]:
    """Start the claimed input's copy out at the layer's entry (Note: [The copy out starts at
    the layer's entry]); return the group and the input's version then."""
    if not claimed:
        return None, 0
    _wait_oldest_copies(manager.copying_earlier(), manager.config)
    group = manager.swap_out(claimed, copy_span=True, compute_stream=entry_stream)
    return group, claimed[0]._version


def _swap_after_forward(manager: SwapLayerInputManager, hidden_states: torch.Tensor,
                        claimed: list[torch.Tensor], result: Any, api: str,
                        grad_at_entry: bool, since: int,
                        entry_stream: torch.Stream | None = None,
                        started: tuple[SwapTensors | None, int] = (None, 0)) -> None:
    if grad_at_entry:
        outputs = grad_outputs(result, api)
        kept = bool(outputs) or hidden_states.requires_grad
    else:  # outputs' graphs are the checkpoint's to discard (Note: [Grad mode at layer entry])
        _mark_region_outputs(result, api)
        outputs, kept = [], hidden_states.requires_grad and not _in_region(hidden_states)
    group, version = started
    if group is not None and (not kept or claimed[0]._version != version):
        manager.keep_on_device(group)  # stale or unneeded: see the Note above
        group = None
    earlier = manager.copying_earlier()
    roots = [*outputs, hidden_states]  # the input last: walked first (Note: [Ownership rule])
    if not kept:  # inference, or inside a checkpointed region: nothing keeps the input; a group
        free_previous(earlier, roots, abandon=False)  # the region started waits for the next
        return
    previous = _in_flight_out(earlier, manager.previous)  # before free_previous frees it
    if group is None and claimed:  # its compute stream: the one current at the layer's entry
        _wait_oldest_copies(earlier, manager.config)
        group = manager.swap_out(claimed, copy_span=True, compute_stream=entry_stream)
    elif group is None:
        if not manager.is_last_layer and swap_allowed():  # counted by reason by the claim
            _miss(manager)
    if group is not None:
        group.previous_link = _weak(previous)
        group.entry_mark = since
    if outputs:
        BackwardGuard(manager, group, previous).attach(outputs)
    elif group is not None:  # guarded by the next call whose input left the region, if any
        manager.chain.maybe_unguarded = True
    free_previous(earlier, roots)  # its groups are still in "d2h": our swap_out() left them alone


def run_layer(layer: torch.nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict,
              api: str) -> Any:
    """Run ``call(*args, **kwargs)`` (the layer's forward) under the SwapLayerInput protocol.

    Any exception on the way (the layer itself, an in-place write caught at free time) brings
    every group of the layer's chain back to the device before it propagates.
    """
    if _graph_task_id() != -1:  # in_backward(): a recomputation, the input is already back
        return call(*args, **kwargs)
    manager: SwapLayerInputManager = layer.swap_manager
    manager.ensure_registered()
    hidden_states = find_hidden_states(args, kwargs, api)
    ref = manager.layer_parameter  # weak: a registered manager must not keep a parameter alive
    known = ref() if ref is not None else None
    param = check_device(layer, hidden_states, api, known)
    if param is not known:
        manager.layer_parameter = weakref.ref(param) if param is not None else None
    try:
        abandon_own_unguarded(manager)
        grad_at_entry = torch.is_grad_enabled()
        guard_previous_on_input(manager, hidden_states)
        claimed = _claim_input(manager, hidden_states, grad_at_entry)
        entry_stream = entry_compute_stream(hidden_states) if claimed else None
        started = _start_at_entry(manager, claimed, entry_stream)
        since = autograd_mark()
        result = call(*args, **kwargs)
        _swap_after_forward(manager, hidden_states, claimed, result, api, grad_at_entry, since,
                            entry_stream, started)
        if manager.is_last_layer:
            abandon_unguarded_earlier(manager)
            if manager.chain.missed:
                check_step(manager)
    except BaseException:
        abort_chain(manager.chain)
        raise
    return result
