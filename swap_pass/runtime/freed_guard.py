"""A clear error, instead of a crash, for touching a tensor whose device storage is swapped out.

Note: [Guarding freed tensors]
Between ``wait_d2h`` (storage resized to zero bytes) and ``swap_to_device`` (resized back), a
swapped tensor keeps its sizes and strides over an empty storage. A kernel that reads or writes
it runs off the end of the allocation: SIGSEGV on CPU, an illegal address on an accelerator,
before any check of ours could run. Autograd's saved references, views and the user's own
variable are the *same* ``TensorImpl``, so the data cannot be hidden from them, but Python code
reaches the tensor through its one preserved Python object, whose class can change. While the
storage is freed the object's class is :class:`_SwappedOut`, a ``torch.Tensor`` subclass whose
``__torch_function__`` lets metadata through (shape, dtype, grad_fn, ``_version``, the storage
object, autograd hooks) and raises :class:`~swap_pass.SwapDataError` naming the group for
anything that could touch the data. Restoring sets the class back before the storage returns.

The guard stays on from the free until the compute stream waits for the copy back
(``wait_h2d``), not only until the storage is re-allocated: between ``swap_to_device`` and
``wait_h2d`` the storage holds bytes the host-to-device copy is still writing. A Python-level
reader in that window, or of a freed tensor while backward runs (the recomputation of a
checkpoint around several layers reads the first layer's input before that layer's own backward
guard fired), does not get an error: the guard completes the group's restore first (the reader
is the consumer that waits), then lets the call through. In forward a read of a freed tensor
still raises.

What it does not cover: C++ readers (autograd's own kernels; they only run after the backward
guard restored the data), code run under ``torch._C.DisableTorchFunction*``, and other Python
objects over the same storage made before the swap (a ``.detach()`` or view taken earlier;
the layer-input paths keep such a storage on the device instead: Note: [Ownership rule]).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

import torch
from torch.utils._pytree import tree_leaves

from swap_pass.runtime.errors import SwapDataError

__all__ = ["Restorable", "give_up", "guard_freed", "is_guarded", "unguard"]

# Where each guarded tensor's data went, by the tensor's id: a weak reference to the group that
# freed it, or a name (the group gave the tensor up, or none was given). Kept here, not on the
# tensor: an attribute would give each swapped layer input a dict of its own, and the dict and
# its entry would be two more objects that live from the layer's forward to its backward
# (see Note: [Few objects per group] in swap_tensors.py). An entry leaves when its tensor is
# unguarded, or, for a tensor given up, when the tensor dies.
_guards: dict[int, weakref.ref | str] = {}
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
        if group is None or not group.restore_for_reader(torch._C._current_graph_task_id() != -1):
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
