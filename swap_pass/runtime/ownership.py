"""Who else holds a storage: the one rule that decides whether a swap may free it.

Note: [Ownership rule]
    Swapping frees whole storages in place (``untyped_storage().resize_(0)``). That is right only
    when nothing but the swap can read the storage until it is restored. A storage therefore
    leaves the device only if every holder of it is accounted for:

    * the tensors handed to the swap (a layer's input, SmartSwap's aliases of saved tensors);
    * the base of each of them when it is a view (the view keeps its base alive; nobody reads the
      base through it);
    * the output the op that made a layer input saved for its own backward (``tanh``, ``relu``);
    * for a layer input, the views autograd saved while the layer ran (they appear after the
      decision, taken at the layer's entry, and are read only in the layer's backward, after
      the restore).

    Holders are counted with the storage's use count, which counts every tensor (``TensorImpl``)
    over the storage: a sibling view (``x, y = data.chunk(2)``), the tensor a view was taken
    from when the caller still holds it, a module buffer, a ``.detach()``, view or slice that the
    layer (a monitoring hook, a cache) kept while it ran. They are counted when the storage is to
    be freed (after the next layer ran), after the copy out is complete (so the copy's own source
    is gone). Holders beyond the tensors and their bases must each be a tensor autograd saved
    (Note: [Telling saved aliases from kept ones]); a storage with any other holder is never
    freed: the swap keeps it on the device, counts its bytes (``SkipReason.SHARED_STORAGE``,
    ``SwapStats.skipped_shared_bytes``) and warns once per layer.

    User data is never freed either, even when nothing else holds the storage: the use count
    cannot see a caller's Python reference to the very tensor the layer received. User data is
    a leaf that needs no grad (an input batch, a buffer, a tensor made under ``no_grad`` or
    detached) and any view of a leaf (``data[:, :16]``, a micro-batch split of the batch, a view
    of a parameter or buffer); counted in ``SwapStats.skipped_user_bytes``, no warning. What a
    model computes with autograd on (the embedding output, each layer's output) is the model's
    own and may leave, and so may a leaf that requires grad and is not a view: a pipeline
    stage's received activations (the schedule keeps them for their ``.grad`` only), or an
    input whose gradient the caller asked for, which reads as swapped out (``SwapDataError``)
    until backward and comes back intact after it, or when the graph is dropped. A whole alias
    of such a leaf counts as the leaf (Note: [Whole aliases of a received leaf]).

    When the tensors span only part of a storage that nobody else holds (a layer input that is
    a slice of a larger activation), only the bytes they span are copied to the host; the
    storage is freed whole and the span is copied back into it on restore.

Note: [Telling saved aliases from kept ones]
    Inside a layer, autograd saves views of its input for backward (``F.linear`` on a 3-D input
    saves a 2-D view of it; ``x.transpose(1, 2) @ w`` saves the transpose): each is a tensor over
    the input's storage, exactly like a ``.detach()`` a monitoring hook keeps. They are told
    apart by looking at what autograd saved: from the graph roots the caller passes (the next
    layer's outputs, or the value entering it), the walk visits the backward nodes made since
    the layer's entry (autograd's sequence number, read at the entry, bounds it) and collects
    the distinct tensors their saved variables hold over the storage. A saved tensor that also
    has a Python reference of its own (a view the layer both kept and used) counts as kept.
    Anything else is kept: holders the walk cannot see stay on the device, never the reverse
    (views packed by saved-tensor hooks, whose packed object is not visible: the user's own
    identity hooks, ``save_on_cpu`` on a CPU tensor, whose ``.cpu()`` is the tensor itself;
    a custom ``autograd.Function`` that keeps a view on ``ctx`` outside ``save_for_backward``,
    an in-place op on a view of the input, a reader outside the layer on a branch the roots do
    not reach). The walk runs only when the use count shows a holder beyond the tensors and
    their bases, which the common Transformer layer (normalization first) never has.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence

import torch

from swap_pass.runtime.skips import SkipReason, record_skip

__all__ = ["account_holders", "autograd_mark", "byte_span", "is_user_data", "may_free",
           "outside_holders", "saved_aliases", "swappable_layer_inputs"]

_use_count = torch._C._storage_Use_Count
# What a storage held by one tensor reads as: 2 on torch 2.11 and 2.13 (the Python storage object
# made by untyped_storage() counts), 1 on torch 2.6. Measured once, so that "nobody but these
# tensors" holds on every release.
def _measure_one_holder() -> int:
    t = torch.empty(1)  # held while its storage is counted
    return _use_count(t.untyped_storage()._cdata)


_ONE_HOLDER = _measure_one_holder()

_warned_lock = threading.Lock()
_warned_layers: set[str] = set()


def _holders(t: torch.Tensor) -> int:
    """Tensors (and Python storage objects) now holding ``t``'s storage, ``t`` included."""
    return _use_count(t.untyped_storage()._cdata) - (_ONE_HOLDER - 1)


def outside_holders(tensors: Sequence[torch.Tensor]) -> int:
    """Holders of the tensors' storage other than ``tensors`` and their view bases.

    Args:
        tensors: Tensors over one storage (a layer input, or aliases of saved tensors).

    Returns:
        0 when the storage is held by ``tensors`` (and their bases) alone; see
        Note: [Ownership rule].
    """
    if len(tensors) == 1 and tensors[0]._base is None:  # a layer input that is no view
        t = tensors[0]
        extra = _holders(t) - 1
        return extra if extra <= 0 else extra - _saved_as_output(t)
    known = {t._cdata: t for t in tensors}
    known.update((t._base._cdata, t._base) for t in tensors if t._base is not None)
    extra = _holders(tensors[0]) - len(known)
    if extra <= 0:  # the common case: no saved output to look for
        return extra
    return extra - sum(_saved_as_output(t) for t in known.values())


def _saved_as_output(t: torch.Tensor) -> int:
    """Tensors autograd keeps over ``t``'s storage as the saved output of the op that made ``t``.

    An op whose backward reads its result (``tanh``, ``relu``, ``sigmoid``, ``exp``) saves it as
    a separate tensor over the same storage: an autograd saved reference, read only in that op's
    backward, after the layer that takes ``t`` restored it. Saved outputs packed by
    saved-tensor hooks (checkpointing) hold no tensor and are not unpacked here.
    """
    fn = t.grad_fn
    if fn is None:
        return 0
    names = _saved_result_names(type(fn))
    if not names:
        return 0
    key = t.untyped_storage().data_ptr()
    count = 0
    for name in names:
        raw = getattr(fn, name)
        if isinstance(raw, torch._C._autograd.SavedTensor) and raw.unpack_hook is None:
            data = raw.data
            count += data is not None and data.untyped_storage().data_ptr() == key
    return count


@functools.cache
def _saved_result_names(node_type: type) -> tuple[str, ...]:
    """The attributes of a backward node class that hold its op's saved result."""
    return tuple(name for name in dir(node_type) if name.startswith("_raw_saved_result"))


def is_user_data(t: torch.Tensor) -> bool:
    """True for views of leaves (inputs, parameters, buffers) and leaves that need no grad.

    A leaf that requires grad and is not a view (a pipeline stage's received activations, an
    input whose gradient the caller asked for) is handed to the model like an activation, and
    so is a whole alias of one (Note: [Whole aliases of a received leaf]).
    """
    base = t._base
    if base is None:
        return t.grad_fn is None and not t.requires_grad
    if base.grad_fn is not None:
        return False
    return not _is_whole_alias_of_grad_leaf(t, base)


def _is_whole_alias_of_grad_leaf(t: torch.Tensor, base: torch.Tensor) -> bool:
    """True when ``t`` reads exactly ``base``'s bytes and ``base`` is a leaf that requires grad
    and is no parameter.

    Note: [Whole aliases of a received leaf]
        An autograd Function that returns its input as is hands on a view of it with a new
        ``grad_fn``: FSDP2's pre-forward hook does so with every input that requires grad (its
        ``RegisterPostBackwardFunction``), so a pipeline stage sharded with ``fully_shard`` gives
        its first block an alias of the received activation, not the leaf itself. Such an alias
        is the leaf under another name: it is treated as the leaf is (swappable), and the leaf
        joins the swap with it, so that the caller's reference to the leaf reads as swapped out
        (``SwapDataError``) until backward rather than reading a freed storage; a part of a
        leaf (``x[:, :16]``) and anything over a ``torch.nn.Parameter`` stay the caller's.
    """
    if not base.requires_grad or isinstance(base, torch.nn.Parameter):
        return False
    if t.storage_offset() != base.storage_offset() or t.numel() != base.numel():
        return False
    return (t.shape == base.shape and t.stride() == base.stride()) or (
        t.is_contiguous() and base.is_contiguous())


def byte_span(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    """``[lo, hi)``: the bytes of their (one) storage that ``tensors`` can read."""
    lo, hi = None, 0
    for t in tensors:
        if t.numel() == 0:
            continue
        size, offset = t.element_size(), t.storage_offset()
        if t.is_contiguous():  # the common case, and the same span as the general formula
            last = offset + t.numel() - 1
        else:
            last = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        start, end = offset * size, (last + 1) * size
        lo, hi = (start if lo is None else min(lo, start)), max(hi, end)
    return (0, 0) if lo is None else (lo, hi)


def swappable_layer_inputs(tensors: Sequence[torch.Tensor], layer: str, *,
                           leaves_owned: bool = False) -> list[torch.Tensor]:
    """The tensors among a layer's inputs whose storage may leave the device.

    Called at the layer's entry, before the layer runs. User data is left out (counted in
    ``skipped_user_bytes``); other holders of a storage are counted when it is to be freed
    (:func:`may_free`). ``leaves_owned``: the caller made its leaves itself and hands them over
    (FBOverlap runs every layer on a detached copy of the previous output); only the holder
    count applies then.
    """
    if leaves_owned:
        return list(tensors)
    keep = []
    for t in tensors:
        if is_user_data(t):
            record_skip(SkipReason.USER_DATA, t.untyped_storage().nbytes(), where=layer)
            continue
        keep.append(t)
        base = t._base
        if base is not None and base.grad_fn is None and all(k is not base for k in keep):
            keep.append(base)  # a received leaf under an alias: guarded with it, see the Note
    return keep


_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


def autograd_mark() -> int:
    """The sequence number the next autograd node made on this thread gets: read at a layer's
    entry, it bounds :func:`may_free`'s walk to the nodes made since (0: no bound known)."""
    return _get_sequence_nr() if _get_sequence_nr is not None else 0


def may_free(tensors: Sequence[torch.Tensor], layer: str, *,
             roots: Sequence[torch.Tensor] = (), since: int = 0,
             accounted: Sequence[torch.Tensor] = ()) -> bool:
    """At free time: whether a group's layer inputs may leave (Note: [Ownership rule]).

    Call it once the copy out is complete (its source no longer counts). Every holder of the
    storage beyond ``tensors`` and their bases must be a tensor autograd saved in the graph
    reachable from ``roots`` through nodes made since ``since`` (Note: [Telling saved aliases
    from kept ones]); otherwise the storage stays on the device, counted in
    ``skipped_shared_bytes``, with one warning per ``layer``.

    Args:
        tensors: The group's tensors (one storage, or several).
        layer: The layer's name, for the warning.
        roots: Tensors whose graph holds the layer's backward (its outputs, the next layer's
            outputs, or the value entering the next layer). Default: ``()``.
        since: :func:`autograd_mark` at the layer's entry. Default: ``0``.
        accounted: Other tensors over the storage whose readers the caller's protocol orders
            after the restore (FBOverlap's ``LayerGraph.layer_input``, read only by the
            recompute its backward wrapper restores first). Default: ``()``.
    """
    if not tensors:
        return True
    if _entry_holders:
        accounted = [*accounted, *_accounted_at_entry(tensors)]
    if len(tensors) == 1 and not accounted and outside_holders(tensors) <= 0:
        return True  # the common case: a layer input nothing else holds
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        by_storage.setdefault(t.untyped_storage()._cdata, []).append(t)
    for t in accounted:
        key = t.untyped_storage()._cdata
        if key in by_storage and all(t._cdata != u._cdata for u in by_storage[key]):
            by_storage[key].append(t)
    for group in by_storage.values():
        extra = outside_holders(group)
        if extra > 0:
            extra -= saved_aliases(group, roots, since, enough=extra)
        if extra > 0:
            t = group[0]
            record_skip(SkipReason.SHARED_STORAGE, t.untyped_storage().nbytes(), warn=False)
            _warn_shared(layer, t, extra)
            return False
    return True


# Holders a claim accounted for at a layer's entry besides the input and its view base: the
# local tensors of a wrapper subclass's view bases (Note: [Swapping through the local tensor] in
# ``subclasses.py``), which the wrapper keeps alive and nobody reads through. By id with weak
# references: a WeakKeyDictionary would compare tensors with ``==``.
_entry_holders: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}


def account_holders(t: torch.Tensor, holders: Sequence[torch.Tensor]) -> None:
    """Have :func:`may_free` count ``holders`` as known holders of ``t``'s storage while ``t``
    lives (a wrapper's base locals, found when its layer was entered)."""
    if not holders:
        return
    key = id(t)
    _entry_holders[key] = (weakref.ref(t, lambda _, key=key: _entry_holders.pop(key, None)),
                           [weakref.ref(h) for h in holders])


def _accounted_at_entry(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    found = []
    for t in tensors:
        entry = _entry_holders.get(id(t))
        if entry is not None and entry[0]() is t:
            found.extend(h for ref in entry[1] if (h := ref()) is not None)
    return found


# The walk gives up (what it did not see stays unexplained: the storage is kept) past this many
# backward nodes: a bound for the torch releases without a sequence number to read.
_MAX_NODES = 20_000


def saved_aliases(tensors: Sequence[torch.Tensor], roots: Sequence[torch.Tensor], since: int,
                  enough: int | None = None) -> int:
    """Distinct tensors, other than ``tensors`` and their bases, that autograd saved over their
    storage in the nodes reachable from ``roots`` and made since ``since``, and that nothing
    else references from Python (Note: [Telling saved aliases from kept ones]).

    Stops early once ``enough`` are found.
    """
    key = tensors[0].untyped_storage()._cdata
    known = {t._cdata for t in tensors}
    known.update(t._base._cdata for t in tensors if t._base is not None)
    found: set[int] = set()
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    seen: dict[int, object] = {}  # the nodes themselves: their ids stay theirs while we walk
    wrapped: dict[int, list] = {}  # saved DTensors: [the DTensor, times saved] (see the Note)
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if id(node) in seen or node._sequence_nr() < since:
            continue
        seen[id(node)] = node
        _collect_saved(node, key, known, found, wrapped)
        if enough is not None and len(found) >= enough:
            break
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    for entry in wrapped.values():
        local = _saved_local(entry)
        if (local is not None and local.untyped_storage()._cdata == key
                and local._cdata not in known):
            found.add(local._cdata)
    return len(found)


def _collect_saved(node, key: int, known: set[int], found: set[int],
                   wrapped: dict[int, list]) -> None:
    """Add to ``found`` the saved tensors of ``node`` over storage ``key`` that only autograd
    holds; count the saved DTensors in ``wrapped`` (judged after the walk)."""
    for name in _saved_tensor_names(type(node)):
        raw = getattr(node, name, None)
        for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
            if (not isinstance(saved, torch._C._autograd.SavedTensor)
                    or saved.unpack_hook is not None):
                continue
            data = saved.data
            if data is not None and type(data) is not torch.Tensor:
                entry = wrapped.setdefault(id(data), [data, 0])
                entry[1] += 1
                continue
            if (data is None or data._cdata in known or data._cdata in found
                    or data.untyped_storage()._cdata != key):
                continue
            if sys.getrefcount(data) <= _SAVED_ALIAS_REFS:  # no Python reference of its own
                found.add(data._cdata)
            else:
                known.add(data._cdata)  # kept by someone: a holder the walk does not explain


# Note: [Saved DTensor aliases]
#     Under sequence parallel with plain activations between blocks (``use_local_output=True``,
#     torchtitan up to 0.2), each ``SequenceParallel`` norm wraps the block's input with
#     ``DTensor.from_local``: a DTensor whose local tensor is an alias of the input, which the
#     norm's backward saves (inside the DTensor, once per node that saves it). That local tensor
#     holds the input's storage, but it is autograd's own when nothing but the saved DTensor holds
#     it and nothing but the saved variables the walk met hold that DTensor: both reference counts
#     are as low as they can be. Anything more (a caller's DTensor over the same local tensor, a
#     kept ``to_local()``, a saving node outside the walk) stays a holder. The first block's
#     input is the embedding's ``AsyncCollectiveTensor``: there the DTensor's local tensor is an
#     ``AsyncCollectiveTensor`` too, and its result must be held by it alone as well.


def _excess_refs(entry: list) -> int:
    """References to ``entry[0]`` beyond the ``entry[1]`` saved variables that hold it."""
    data = entry[0]
    return sys.getrefcount(data) - entry[1]


def _measure_excess_refs() -> int:
    """:func:`_excess_refs` of an object that one saved variable alone holds."""
    saved_variable = [object()]
    return _excess_refs([saved_variable[0], 1])


_EXCESS_REFS = _measure_excess_refs()


def _attr_refs(holder: object, attr: str) -> int:
    """``sys.getrefcount`` of ``getattr(holder, attr)``, read the same way for every caller."""
    value = getattr(holder, attr)
    return sys.getrefcount(value)


# Per wrapper class: _attr_refs of its inner tensor when the wrapper alone holds it (a DTensor
# may keep more than one reference to its local tensor): measured once, on a fresh wrapper.
_alone: dict[type, int] = {}


def _refs_when_alone(wrapper: torch.Tensor, attr: str) -> int:
    cls = type(wrapper)
    if cls not in _alone:
        if attr == "elem":  # an AsyncCollectiveTensor
            fresh = cls(torch.empty(0))
        else:  # a DTensor: its own spec, an empty local tensor
            fresh = cls(torch.empty(0), wrapper._spec, requires_grad=False)
        _alone[cls] = _attr_refs(fresh, attr)
    return _alone[cls]


def _inner_alone(wrapper: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor inside ``wrapper`` (a DTensor, an AsyncCollectiveTensor, or a DTensor
    over one) when each level alone holds the next; None otherwise."""
    from swap_pass.runtime.subclasses import is_async_collective, is_dtensor

    for _ in range(2):  # a DTensor over an AsyncCollectiveTensor is two levels
        if type(wrapper) is torch.Tensor:
            return wrapper
        attr = ("_local_tensor" if is_dtensor(wrapper) else
                "elem" if is_async_collective(wrapper) else None)
        if attr is None or _attr_refs(wrapper, attr) > _refs_when_alone(wrapper, attr):
            return None
        wrapper = getattr(wrapper, attr)
    return wrapper if type(wrapper) is torch.Tensor else None


def _saved_local(entry: list) -> torch.Tensor | None:
    """The plain tensor inside a saved DTensor (``entry``: it and the times it was saved) that
    only autograd holds (Note: [Saved DTensor aliases]); None for anything else."""
    from swap_pass.runtime.subclasses import is_dtensor

    if not is_dtensor(entry[0]) or _excess_refs(entry) > _EXCESS_REFS:
        return None
    return _inner_alone(entry[0])


@functools.cache
def _saved_tensor_names(node_type: type) -> tuple[str, ...]:
    """The attributes of a backward node class that hold saved variables."""
    return tuple(name for name in dir(node_type) if name.startswith("_raw_saved_"))


def _measure_saved_alias_refs() -> int:
    """``sys.getrefcount`` of a saved view that only autograd holds, as :func:`_collect_saved`
    reads it (the count differs between torch releases: measured, not assumed)."""
    x = torch.ones(2, 2, requires_grad=True).clone()
    out = x.view(4).mul(torch.ones(4, requires_grad=True))
    data = out.grad_fn._raw_saved_self.data
    return sys.getrefcount(data)


_SAVED_ALIAS_REFS = _measure_saved_alias_refs()


def _warn_shared(layer: str, t: torch.Tensor, extra: int) -> None:
    with _warned_lock:
        if layer in _warned_layers:
            return
        _warned_layers.add(layer)
    warnings.warn(
        f"swap_pass: the input of {layer} (shape {tuple(t.shape)}, {t.dtype}) shares its storage "
        f"({t.untyped_storage().nbytes()} bytes) with {extra} other live tensor(s) (a sibling "
        "view, the tensor it was sliced from, a buffer, a .detach() or view of it kept while the "
        "layers ran). It stays on the device (swap_stats().skipped_shared_bytes counts it). Pass "
        "the layer a tensor of its own (e.g. a .clone() of the slice) and keep .clone()s rather "
        f"than views of it to have it swapped.{_alias_hint(t)} (Shown once per layer.)",
        RuntimeWarning,
        stacklevel=4,
    )


def _alias_hint(t: torch.Tensor) -> str:
    """What the shared-storage warning adds for a whole alias of a received leaf."""
    if t._base is None or not _is_whole_alias_of_grad_leaf(t, t._base):
        return ""
    return (" It is an alias of a leaf that requires grad (a pipeline stage's received "
            "activation), made by an autograd Function that returns its input as is, as FSDP2's "
            "fully_shard does on every sharded module: with fully_shard on both the stage and its "
            "first block, the stage's alias is the other holder.")


def rearm_warnings() -> None:
    """Let each layer's shared-storage warning show again (called by :func:`swap_pass.reset`)."""
    with _warned_lock:
        _warned_layers.clear()
