"""May a swap free this storage: the ownership rule, wrapper subclasses, the guard on what it freed.

Three sections, in the order a freed tensor meets them: the guard (a clear error, not a crash,
for touching a tensor whose storage is swapped out), wrapper subclasses (which plain tensor holds
a ``DTensor``'s or an ``AsyncCollectiveTensor``'s data) and the ownership rule itself, whose entry
is :func:`may_free`. Every calibration the rule needs (the use count of a storage one tensor
holds, the references a wrapper keeps to its local tensor, those autograd's saved aliases keep) is
measured once (at import; per wrapper class, at its first wrapper), beside the function that
reads it.

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
import weakref
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch.utils._pytree import tree_leaves

from swap_pass.runtime.errors import SwapDataError
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.state import entry_holders as _entry_holders
from swap_pass.state import guards as _guards
from swap_pass.state import refs_when_alone as _alone
from swap_pass.state import warn_once

__all__ = ["Restorable", "account_holders", "autograd_mark", "byte_span", "claim_not_plain",
           "give_up", "guard_freed", "holders", "in_backward", "is_async_collective", "is_dtensor",
           "is_guarded", "is_user_data", "local_tensor", "may_free", "outside_holders",
           "saved_aliases", "subclass_nbytes", "swappable_layer_inputs", "unguard"]


# --- A clear error, instead of a crash, for touching a tensor whose device storage is swapped out
# ---
# Note: [Guarding freed tensors]
# Between ``wait_d2h`` (storage resized to zero bytes) and ``swap_to_device`` (resized back), a
# swapped tensor keeps its sizes and strides over an empty storage. A kernel that reads or writes
# it runs off the end of the allocation: SIGSEGV on CPU, an illegal address on an accelerator,
# before any check of ours could run. Autograd's saved references, views and the user's own
# variable are the *same* ``TensorImpl``, so the data cannot be hidden from them, but Python code
# reaches the tensor through its one preserved Python object, whose class can change. While the
# storage is freed the object's class is :class:`_SwappedOut`, a ``torch.Tensor`` subclass whose
# ``__torch_function__`` lets metadata through (shape, dtype, grad_fn, ``_version``, the storage
# object, autograd hooks) and raises :class:`~swap_pass.SwapDataError` naming the group for
# anything that could touch the data. Restoring sets the class back before the storage returns.
#
# The guard stays on from the free until the compute stream waits for the copy back
# (``wait_h2d``), not only until the storage is re-allocated: between ``swap_to_device`` and
# ``wait_h2d`` the storage holds bytes the host-to-device copy is still writing. A Python-level
# reader in that window, or of a freed tensor while backward runs (the recomputation of a
# checkpoint around several layers reads the first layer's input before that layer's own backward
# guard fired), does not get an error: the guard completes the group's restore first (the reader
# is the consumer that waits), then lets the call through. In forward a read of a freed tensor
# still raises.
#
# What it does not cover: C++ readers (autograd's own kernels; they only run after the backward
# guard restored the data), code run under ``torch._C.DisableTorchFunction*``, and other Python
# objects over the same storage made before the swap (a ``.detach()`` or view taken earlier;
# the layer-input paths keep such a storage on the device instead: Note: [Ownership rule]).


# Where each guarded tensor's data went is in state.guards, by the tensor's id, not on the
# tensor: an attribute would give each swapped layer input a dict of its own, and the dict and
# its entry would be two more objects that live from the layer's forward to its backward
# (see Note: [Few objects per group] in group.py). An entry leaves when its tensor is
# unguarded, or, for a tensor given up, when the tensor dies.
_UNNAMED = "a swap group"


class Restorable(Protocol):
    """What :func:`guard_freed` needs of the group that freed the tensors."""

    name: str | None  # shown in errors

    def restore_for_reader(self, in_backward: bool) -> bool:
        """Bring the data back for a reader if that is safe; return whether it is back."""

# Reading these touches no element of the tensor.
_METADATA_METHODS = frozenset({
    torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.ndimension,
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.storage_offset,
    torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.element_size,
    torch.Tensor.is_contiguous, torch.Tensor.get_device, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.requires_grad_,
    torch.Tensor.retain_grad, torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.is_pinned,
    torch.Tensor.is_inference, torch.Tensor._is_view, torch.Tensor.__len__, torch.Tensor.__hash__,
    # Backward itself: it runs the layers' backward guards, which restore the data first.
    torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward,
})
_METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "names", "requires_grad", "grad_fn", "is_leaf",
    "grad", "retains_grad", "_version", "_base", "output_nr", "_cdata", "itemsize", "nbytes",
    "is_cpu", "is_cuda", "is_xpu", "is_mps", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "name", "_backward_hooks", "_post_accumulate_grad_hooks",
})
_SETTABLE_ATTRIBUTES = frozenset({"requires_grad", "grad", "retains_grad", "name",
                                  "_backward_hooks", "_post_accumulate_grad_hooks"})


def _describe(func) -> tuple[str, bool]:
    """``func``'s name, and whether it only touches metadata."""
    if getattr(func, "__name__", None) in ("__get__", "__set__"):  # a property of the tensor
        attribute = getattr(func.__self__, "__name__", "?")
        allowed = _SETTABLE_ATTRIBUTES if func.__name__ == "__set__" else _METADATA_ATTRIBUTES
        return f"Tensor.{attribute} ({func.__name__.strip('_')})", attribute in allowed
    try:
        allowed = func in _METADATA_METHODS
    except TypeError:  # unhashable callable
        allowed = False
    name = getattr(func, "__qualname__", None) or repr(func)
    return name.replace("TensorBase.", "Tensor.", 1), allowed


class _SwappedOut(torch.Tensor):
    """The class of a tensor while its device storage is freed
    (see Note: [Guarding freed tensors])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            return _repr(args[0])
        name, allowed = _describe(func)
        if allowed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _restore_all(tree_leaves((args, kwargs))):
            return func(*args, **kwargs)  # the guarded tensors are plain tensors again
        guarded = next((t for t in tree_leaves((args, kwargs)) if is_guarded(t)), None)
        what = ("a swapped tensor" if guarded is None else
                f"a tensor of {_where(guarded)} (shape {tuple(guarded.shape)}, {guarded.dtype})")
        raise SwapDataError(
            f"swap_pass.SwapTensors: {name} was called on {what} while its data is swapped out to "
            "host memory and its device storage is freed. A swapped tensor can be read again "
            "only after backward swapped it back in; clone it before the layer that swaps it "
            "out runs if it is needed earlier (e.g. HF output_hidden_states)."
        )


def _repr(t: torch.Tensor) -> str:
    return (f"tensor(<swapped out by swap_pass: {_where(t)}>, size={tuple(t.shape)}, "
            f"dtype={t.dtype}, device='{t.device}')")


def _group(t: torch.Tensor) -> Restorable | None:
    guard = _guards.get(id(t))
    return guard() if isinstance(guard, weakref.ref) else None


def _where(t: torch.Tensor) -> str:
    guard = _guards.get(id(t))
    if isinstance(guard, str):
        return guard
    group = guard() if guard is not None else None
    return (group.name if group is not None else None) or _UNNAMED


def _restore_all(leaves: list) -> bool:
    """Restore the groups of every guarded leaf when a reader may wait for them; True if done.

    A group in flight back to the device (``"h2d"``) is always restored: its data is coming and
    the reader is its consumer. A freed group is restored only inside backward.
    """
    guarded = [t for t in leaves if is_guarded(t)]
    for t in guarded:
        group = _group(t)
        if group is None or not group.restore_for_reader(in_backward()):
            return False
    return not any(is_guarded(t) for t in guarded)


def is_guarded(obj: object) -> bool:
    """True for a tensor whose device storage is freed by a swap."""
    return type(obj) is _SwappedOut


def guard_freed(tensors: Iterable[torch.Tensor], group: Restorable | str) -> None:
    """Make Python-level reads and writes of ``tensors`` raise :class:`SwapDataError`.

    Args:
        tensors: Plain ``torch.Tensor`` objects whose storage was just freed. The caller holds
            them until it calls :func:`unguard` or :func:`give_up`.
        group: The group that freed them, held weakly: a reader that may wait asks it to bring
            the data back, and the error names it (its ``name``). Or only a name: readers always
            get the error.
    """
    guard = group if isinstance(group, str) else weakref.ref(group)
    for t in tensors:
        if type(t) is torch.Tensor:
            t.__class__ = _SwappedOut
            _guards[id(t)] = guard


def unguard(tensors: Iterable[torch.Tensor]) -> None:
    """Undo :func:`guard_freed` (before the storage is given back its bytes)."""
    for t in tensors:
        if type(t) is _SwappedOut:
            t.__class__ = torch.Tensor
            _guards.pop(id(t), None)


def give_up(tensors: Iterable[torch.Tensor], group: Restorable) -> None:
    """``group``, which freed ``tensors``, lets go of them, their data not restored: they stay
    guarded for good, the error naming the group, and the entry leaves with the tensor."""
    where = group.name or _UNNAMED
    for t in tensors:
        if type(t) is _SwappedOut:
            key = id(t)
            _guards[key] = where
            weakref.finalize(t, _guards.pop, key, None)


# --- wrapper subclasses: which plain tensor holds their data --------------------------------------
# Note: [Swapping through the local tensor]
# Tensor parallel gives layers ``DTensor`` inputs (torchtitan's plans, ``use_local_output=False``)
# or ``AsyncCollectiveTensor`` ones (the output of a collective not waited for yet, what a
# classic plan's ``to_local()`` hands the first layer). Both are wrapper subclasses: the
# wrapper has no storage of its own (``untyped_storage()`` on it is an invalid Python storage),
# and its data is one plain tensor it holds, ``DTensor._local_tensor`` or
# ``AsyncCollectiveTensor.elem``. Autograd saves the wrapper, and every kernel that reads it
# (forward, backward, recomputation) reads that plain tensor; so freeing the plain tensor's
# storage in place and restoring it before backward swaps the wrapper, with the same exact
# gradients as a plain layer input.
#
# * An ``AsyncCollectiveTensor`` is waited for first (``trigger_wait()``, on the compute
#   stream, as its first reader would), so the copy out reads the collective's result.
# * The ownership rule (Note: [Ownership rule] above) sees through the wrapper:
#   whether the input is user data is asked of the wrapper (its ``grad_fn``, its view base),
#   never of the plain tensor, which has no autograd history of its own; whether another
#   tensor shares the storage is asked of the plain tensor.
# * Any other subclass stays on the device, counted under ``SkipReason.SUBCLASS`` and warned
#   about once per layer.


def _loaded_class(module: str, name: str) -> type | None:
    """``module.name`` once ``module`` is imported; else None: no instance of it can exist yet,
    and importing it here would cost every model."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a parameter one too)."""
    cls = _loaded_class("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(t, cls)


def is_async_collective(t: torch.Tensor) -> bool:
    """True for an ``AsyncCollectiveTensor`` (a functional collective's result)."""
    cls = _loaded_class("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding the data of ``t``, a wrapper subclass; None if it has none.

    A ``DTensor`` gives ``_local_tensor`` (unwrapped again when that is itself a wrapper, e.g. an
    ``AsyncCollectiveTensor``); an ``AsyncCollectiveTensor`` is waited for, then gives ``elem``.
    See Note: [Swapping through the local tensor].
    """
    for _ in range(4):  # a DTensor over an AsyncCollectiveTensor is two levels; no more nest
        if type(t) is torch.Tensor or is_guarded(t):  # a guarded one is plain, swapped out
            return t
        if is_dtensor(t):
            t = t._local_tensor
        elif is_async_collective(t):
            t.trigger_wait()
            t = t.elem
        else:
            return None
    return None


def subclass_nbytes(t: torch.Tensor) -> int:
    """Bytes a subclass tensor keeps on the device, as far as it can tell (its inner tensors'
    storages, else its own size)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        try:
            names, _ = flatten()
            inner = [getattr(t, name) for name in names]
            return sum(subclass_nbytes(x) if type(x) is not torch.Tensor
                       else x.untyped_storage().nbytes() for x in inner)
        except Exception:  # an unusual subclass: fall back to its logical size
            pass
    return t.numel() * t.element_size()


def _no_storage(t: torch.Tensor) -> bool:
    return t.is_meta or t.layout != torch.strided or t.is_nested


def claim_not_plain(t: torch.Tensor, layer: str, custom_check_fn, *,
                    leaves_owned: bool = False) -> torch.Tensor | None:
    """A layer input that :func:`~swap_pass.runtime.group.is_valid_for_swap` refused:
    the plain tensor to swap in its place (a wrapper's local tensor that may leave), or None,
    the reason counted in ``swap_stats().skipped_bytes``.

    See Note: [Swapping through the local tensor]; the rest of the rule is
    :func:`~swap_pass.runtime.freeing.swappable_layer_inputs`'.
    """
    if not isinstance(t, torch.Tensor):
        return None
    if isinstance(t, torch.nn.Parameter) or getattr(t, "_is_param", False) or (
            t._base is not None and isinstance(t._base, torch.nn.Parameter)):
        record_skip(SkipReason.USER_DATA, _nbytes(t), where=layer)
        return None
    if type(t) is torch.Tensor or is_guarded(t):
        _skip_plain(t, layer, custom_check_fn)
        return None
    local = local_tensor(t)
    if local is None or _no_storage(local) or local.untyped_storage().nbytes() == 0:
        record_skip(SkipReason.SUBCLASS, subclass_nbytes(t), where=layer, detail=(
            f"A {type(t).__name__} layer input has no plain local tensor to swap; only DTensor "
            "and AsyncCollectiveTensor inputs are swapped through their local data."))
        return None
    if not leaves_owned and _wrapper_is_user_data(t):
        record_skip(SkipReason.USER_DATA, local.untyped_storage().nbytes(), where=layer)
        return None
    if custom_check_fn is not None and not custom_check_fn(t):
        record_skip(SkipReason.CUSTOM_CHECK, local.untyped_storage().nbytes(), where=layer)
        return None
    bases = _base_locals(t, local)
    account_holders(local, bases)  # known holders again when the storage is to be freed
    if outside_holders([local, *bases]) <= 0:
        return local
    return swappable_layer_inputs([local], layer, leaves_owned=True)[0]  # checked again at free


def _base_locals(t: torch.Tensor, local: torch.Tensor) -> list[torch.Tensor]:
    """The local tensors of the wrappers ``t`` is a view of, over ``local``'s storage.

    A wrapper's view (``to_local()`` returns one) has a local tensor that is a view of its
    base's local, made below autograd, so without ``_base``: the base's local is one more
    holder of the storage, which the wrapper keeps alive and nobody reads through it (the
    same rule as a plain view's base, Note: [Ownership rule]).
    """
    found, key, base = [], local.untyped_storage().data_ptr(), t._base
    while base is not None:
        inner = local_tensor(base)
        if inner is not None and inner.untyped_storage().data_ptr() == key:
            found.append(inner)
        base = base._base
    return found


def _wrapper_is_user_data(t: torch.Tensor) -> bool:
    """:func:`~swap_pass.runtime.freeing.is_user_data` for a wrapper: asked of the wrapper,
    whose local tensor has no autograd history of its own.

    A wrapper that ``to_local()`` or ``from_local()`` made is a view of a wrapper without
    history, made inside an ``autograd.Function``, with a ``grad_fn``: an activation. A view
    of a leaf that requires grad (a parameter) stays user data, as for plain tensors.
    """
    if t.grad_fn is None:
        return not t.requires_grad
    base = t._base
    return base is not None and base.requires_grad and base.grad_fn is None


def _nbytes(t: torch.Tensor) -> int:
    if (type(t) is torch.Tensor
            or isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor):
        try:
            return t.untyped_storage().nbytes()
        except RuntimeError:
            pass
    return subclass_nbytes(t)


def _skip_plain(t: torch.Tensor, layer: str, custom_check_fn) -> None:
    """Count a plain (or already swapped-out) layer input that may not be swapped."""
    if is_guarded(t) or _no_storage(t) or t.untyped_storage().nbytes() == 0:
        record_skip(SkipReason.NO_STORAGE, 0 if is_guarded(t) or t.is_meta
                    else t.untyped_storage().nbytes(), where=layer, detail=(
                        "The layer input is sparse, nested, meta, empty or already swapped out."))
    elif custom_check_fn is not None:
        record_skip(SkipReason.CUSTOM_CHECK, t.untyped_storage().nbytes(), where=layer)


# --- the ownership rule ---------------------------------------------------------------------------
# (Note: [Ownership rule] in the module docstring.)


_use_count = torch._C._storage_Use_Count
# What a storage held by one tensor reads as: 2 on torch 2.11 and 2.13 (the Python storage object
# made by untyped_storage() counts), 1 on torch 2.6. Measured once, so that "nobody but these
# tensors" holds on every release.
def _measure_one_holder() -> int:
    t = torch.empty(1)  # held while its storage is counted
    return _use_count(t.untyped_storage()._cdata)


_ONE_HOLDER = _measure_one_holder()


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (recompute, double
    backward)."""
    return torch._C._current_graph_task_id() != -1


def holders(t: torch.Tensor) -> int:
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
        extra = holders(t) - 1
        return extra if extra <= 0 else extra - _saved_as_output(t)
    known = {t._cdata: t for t in tensors}
    known.update((t._base._cdata, t._base) for t in tensors if t._base is not None)
    extra = holders(tensors[0]) - len(known)
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
# ``freeing.py``), which the wrapper keeps alive and nobody reads through. By id with weak
# references: a WeakKeyDictionary would compare tensors with ``==``.


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
    warn_once(
        "shared_layer_input", layer,
        f"swap_pass: the input of {layer} (shape {tuple(t.shape)}, {t.dtype}) shares its storage "
        f"({t.untyped_storage().nbytes()} bytes) with {extra} other live tensor(s) (a sibling "
        "view, the tensor it was sliced from, a buffer, a .detach() or view of it kept while the "
        "layers ran). It stays on the device (swap_stats().skipped_shared_bytes counts it). Pass "
        "the layer a tensor of its own (e.g. a .clone() of the slice) and keep .clone()s rather "
        f"than views of it to have it swapped.{_alias_hint(t)} (Shown once per layer.)",
        stacklevel=5,
    )


def _alias_hint(t: torch.Tensor) -> str:
    """What the shared-storage warning adds for a whole alias of a received leaf."""
    if t._base is None or not _is_whole_alias_of_grad_leaf(t, t._base):
        return ""
    return (" It is an alias of a leaf that requires grad (a pipeline stage's received "
            "activation), made by an autograd Function that returns its input as is, as FSDP2's "
            "fully_shard does on every sharded module: with fully_shard on both the stage and its "
            "first block, the stage's alias is the other holder.")
