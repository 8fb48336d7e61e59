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
    from when the caller still holds it, a module buffer. They are counted at the layer's entry,
    and, for an input that had an outside holder then, again when it is to be freed (after the
    next layer ran): a storage with any other holder left is never freed: the swap keeps it on
    the device, counts its bytes (``SwapStats.skipped_shared_bytes``) and warns once per layer.

    User data is never freed either, even when nothing else holds the storage: the use count
    cannot see a caller's Python reference to the very tensor the layer received. User data is
    a leaf that needs no grad (an input batch, a buffer, a tensor made under ``no_grad`` or
    detached) and any view of a leaf (``data[:, :16]``, a micro-batch split of the batch, a view
    of a parameter or buffer); counted in ``SwapStats.skipped_user_bytes``, no warning. What a
    model computes with autograd on (the embedding output, each layer's output) is the model's
    own and may leave, and so may a leaf that requires grad and is not a view: a pipeline
    stage's received activations (the schedule keeps them for their ``.grad`` only), or an
    input whose gradient the caller asked for, which reads as swapped out (``SwapDataError``)
    until backward and comes back intact after it, or when the graph is dropped.

    When the tensors span only part of a storage that nobody else holds (a layer input that is
    a slice of a larger activation), only the bytes they span are copied to the host; the
    storage is freed whole and the span is copied back into it on restore.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Sequence

import torch

from swap_pass.runtime.skips import SkipReason, record_skip

__all__ = ["byte_span", "is_user_data", "may_free", "outside_holders", "swappable_layer_inputs"]

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
        0 when the storage is held by ``tensors`` (and their bases) alone; see Note: [Ownership rule].
    """
    if len(tensors) == 1 and tensors[0]._base is None:  # a layer input that is no view
        t = tensors[0]
        extra = _holders(t) - 1
        return extra if extra <= 0 else extra - _saved_as_output(t)
    known = {id(t): t for t in tensors}
    known.update((id(t._base), t._base) for t in tensors if t._base is not None)
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
    input whose gradient the caller asked for) is handed to the model like an activation.
    """
    if t._base is not None:
        return t._base.grad_fn is None
    return t.grad_fn is None and not t.requires_grad


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
            last = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        start, end = offset * size, (last + 1) * size
        lo, hi = (start if lo is None else min(lo, start)), max(hi, end)
    return (0, 0) if lo is None else (lo, hi)


def swappable_layer_inputs(tensors: Sequence[torch.Tensor], layer: str, *,
                           leaves_owned: bool = False) -> list[torch.Tensor]:
    """The tensors among a layer's inputs whose storage may leave the device.

    Called at the layer's entry, before the layer runs. User data is left out (counted in
    ``skipped_user_bytes``); a storage with a holder outside the layer input and its base is left
    out, counted in ``skipped_shared_bytes`` and warned about once per ``layer``.
    ``leaves_owned``: the caller made its leaves itself and hands them over (FBOverlap runs every
    layer on a detached copy of the previous output); only the holder count applies then.
    """
    keep = []
    for t in tensors:
        if not leaves_owned and is_user_data(t):
            record_skip(SkipReason.USER_DATA, t.untyped_storage().nbytes(), where=layer)
            continue
        if outside_holders([t]) > 0:
            _mark_shared(t)  # checked again when it is to be freed: may_free()
        keep.append(t)
    return keep


# Layer inputs that had another holder at their layer's entry (often the caller's own reference
# to a view the layer received, e.g. through a module hook; it is gone by the time the input is
# freed). They are freed only if no outside holder is left then.
# (By id with a weak reference: a WeakSet would compare tensors with ``==``.)
_shared_at_entry: dict[int, weakref.ref] = {}


def _mark_shared(t: torch.Tensor) -> None:
    key = id(t)
    _shared_at_entry[key] = weakref.ref(t, lambda _, key=key: _shared_at_entry.pop(key, None))


def _was_shared(t: torch.Tensor) -> bool:
    ref = _shared_at_entry.get(id(t))
    return ref is not None and ref() is t


def may_free(tensors: Sequence[torch.Tensor], layer: str) -> bool:
    """At free time: whether a group's layer inputs may leave (Note: [Ownership rule]).

    An input without an outside holder at its layer's entry may (holders that appeared since are
    the views autograd saved in the layer). One that had such a holder may only if none is left
    now; otherwise it stays on the device, counted in ``skipped_shared_bytes``, with one warning
    per ``layer``.
    """
    if not _shared_at_entry:  # the common case: no layer input had an outside holder
        return True
    for t in tensors:
        if _was_shared(t) and (extra := outside_holders([t])) > 0:
            record_skip(SkipReason.SHARED_STORAGE, t.untyped_storage().nbytes(), warn=False)
            _warn_shared(layer, t, extra)
            return False
    return True


def _warn_shared(layer: str, t: torch.Tensor, extra: int) -> None:
    with _warned_lock:
        if layer in _warned_layers:
            return
        _warned_layers.add(layer)
    warnings.warn(
        f"swap_pass: the input of {layer} (shape {tuple(t.shape)}, {t.dtype}) shares its storage "
        f"({t.untyped_storage().nbytes()} bytes) with {extra} other live tensor(s) (a sibling "
        "view, the tensor it was sliced from, a buffer). It stays on the device "
        "(swap_stats().skipped_shared_bytes counts it). Pass the layer a tensor of its own "
        "(e.g. a .clone() of the slice) to have it swapped. (Shown once per layer.)",
        RuntimeWarning,
        stacklevel=4,
    )


def rearm_warnings() -> None:
    """Let each layer's shared-storage warning show again (called by :func:`swap_pass.reset`)."""
    with _warned_lock:
        _warned_layers.clear()
