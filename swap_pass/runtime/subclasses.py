"""Wrapper tensor subclasses as layer inputs: which plain tensor holds their data.

Note: [Swapping through the local tensor]
    Tensor parallel gives layers ``DTensor`` inputs (torchtitan's plans, ``use_local_output=False``)
    or ``AsyncCollectiveTensor`` ones (the output of a collective not waited for yet, what a
    classic plan's ``to_local()`` hands the first layer). Both are wrapper subclasses: the
    wrapper has no storage of its own (``untyped_storage()`` on it is an invalid Python storage),
    and its data is one plain tensor it holds, ``DTensor._local_tensor`` or
    ``AsyncCollectiveTensor.elem``. Autograd saves the wrapper, and every kernel that reads it
    (forward, backward, recomputation) reads that plain tensor; so freeing the plain tensor's
    storage in place and restoring it before backward swaps the wrapper, with the same exact
    gradients as a plain layer input.

    * An ``AsyncCollectiveTensor`` is waited for first (``trigger_wait()``, on the compute
      stream, as its first reader would), so the copy out reads the collective's result.
    * The ownership rule (Note: [Ownership rule] in ``ownership.py``) sees through the wrapper:
      whether the input is user data is asked of the wrapper (its ``grad_fn``, its view base),
      never of the plain tensor, which has no autograd history of its own; whether another
      tensor shares the storage is asked of the plain tensor.
    * Any other subclass stays on the device, counted under ``SkipReason.SUBCLASS`` and warned
      about once per layer.
"""

from __future__ import annotations

import sys

import torch

from swap_pass.runtime.freed_guard import is_guarded
from swap_pass.runtime.ownership import (
    account_holders,
    outside_holders,
    swappable_layer_inputs,
)
from swap_pass.runtime.skips import SkipReason, record_skip

__all__ = ["claim_not_plain", "is_async_collective", "is_dtensor", "local_tensor",
           "subclass_nbytes"]


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
    """A layer input that :func:`~swap_pass.runtime.swap_tensors.is_valid_for_swap` refused:
    the plain tensor to swap in its place (a wrapper's local tensor that may leave), or None,
    the reason counted in ``swap_stats().skipped_bytes``.

    See Note: [Swapping through the local tensor]; the rest of the rule is
    :func:`~swap_pass.runtime.ownership.swappable_layer_inputs`'.
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
    """:func:`~swap_pass.runtime.ownership.is_user_data` for a wrapper: asked of the wrapper,
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
