"""The plain local tensor behind a saved tensor, or why SmartSwap must keep it where it is.

SmartSwap frees and restores whole storages. That needs one plain strided tensor over one
storage; what autograd saves may be something else:

* a ``DTensor`` (tensor parallel activations, FSDP2 and TP parameters): a wrapper whose data is
  its ``._local_tensor``, a plain tensor on this rank. SmartSwap swaps that local tensor and
  hands autograd the wrapper back (see Note: [Saved DTensors]);
* an ``AsyncCollectiveTensor`` (a collective's result, what a classic tensor-parallel plan's
  ``to_local()`` gives), also as a ``DTensor``'s local tensor: a wrapper whose data is ``.elem``.
  SmartSwap waits for it on the compute stream when it is saved, then swaps ``.elem`` (see
  Note: [Saved AsyncCollectiveTensors]);
* sparse (COO, CSR, ...), nested (strided or jagged) and meta tensors: no single plain storage
  (``untyped_storage()`` raises or names only part of the data): kept, ``no_storage``;
* any other tensor subclass (a quantized weight, ``TwoTensor``): its data cannot be reached as
  one plain tensor: kept, ``subclass``.

This is decided from the tensor's type and layout alone, before anything reads a storage.

Note: [Saved DTensors]
    A ``DTensor`` saved for backward holds its local tensor; a ``detach()`` of it is a new
    ``DTensor`` over a new local alias of the same storage (sharing the version counter). SmartSwap
    keeps that detached wrapper for autograd and counts the storage's holders on the local alias:
    the local tensor of an activation is an activation like any plain one (nobody but the wrapper
    the forward made holds it), and once the forward let the wrapper go, only our alias is left.
    Parameters that are ``DTensor`` s (FSDP2 shards, TP weights) are recognized through their
    local tensors' storages: they are model state and never move.

Note: [Saved AsyncCollectiveTensors]
    A classic tensor-parallel plan (``RowwiseParallel()`` with its default ``use_local_output``)
    hands the next module an ``AsyncCollectiveTensor``: the output of a collective not waited
    for yet, whose first non-view op waits (``trigger_wait()``: ``wait_tensor`` on the current
    stream, once). An op that saves it saves the wrapper. The pack hook runs right before that
    op's kernel, which would wait anyway; so SmartSwap's pack waits then, on the compute stream
    (the current one, where the op's own wait would go), before anything reads or copies
    ``.elem``: a copy to the host is ordered after the collective (on an accelerator, the copy
    stream waits on an event the compute stream records after the wait). Autograd gets back
    ``t.detach()``: an ``AsyncCollectiveTensor`` over a new alias of the same ``.elem`` storage
    (a view op, which does not wait), marked completed as ``t`` is, so its readers in backward
    read the restored storage and wait for nothing. The same holds one level down, for a
    ``DTensor`` whose local tensor is an ``AsyncCollectiveTensor``. This is the eager path's
    rule for layer inputs (Note: [Swapping through the local tensor] in
    ``swap_pass/runtime/subclasses.py``); ``tests/smart/test_distributed.py`` (``tp-classic``)
    checks that saved ones are freed and the training is bitwise exact.
"""

from __future__ import annotations

import torch

from swap_pass.runtime.skips import SkipReason
from swap_pass.runtime.subclasses import is_async_collective, is_dtensor

__all__ = ["completed_alias", "is_async_collective", "is_dtensor", "local_of",
           "state_tensors_local", "storage_nbytes", "wait_collective"]


def _collective_of(t: torch.Tensor) -> torch.Tensor | None:
    """The ``AsyncCollectiveTensor`` holding ``t``'s data: ``t``, or a ``DTensor``'s local one."""
    if type(t) is torch.Tensor:  # the common case, before the subclass lookups
        return None
    if is_dtensor(t):
        t = t._local_tensor
    return t if is_async_collective(t) else None


def wait_collective(t: torch.Tensor) -> None:
    """Wait for the collective behind ``t`` (an ``AsyncCollectiveTensor``, or a ``DTensor``
    over one) on the current stream, as its first reader would; nothing for other tensors.
    See Note: [Saved AsyncCollectiveTensors]."""
    act = _collective_of(t)
    if act is not None:
        act.trigger_wait()


def completed_alias(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, with the ``AsyncCollectiveTensor`` in it (``t`` itself or a ``DTensor``'s
    local tensor) marked completed when ``t``'s is: the alias of a waited result waits for
    nothing again."""
    alias = t.detach()
    act, alias_act = _collective_of(t), _collective_of(alias)
    if act is not None and alias_act is not None and act.completed:
        alias_act.completed = True
    return alias


def _plain(t: torch.Tensor) -> torch.Tensor | SkipReason:
    if t.layout != torch.strided or t.is_nested or t.is_meta:
        return SkipReason.NO_STORAGE
    return t


def local_of(t: torch.Tensor) -> torch.Tensor | SkipReason:
    """The plain strided tensor whose storage holds ``t``'s data, or why there is none.

    Returns:
        ``t`` itself for a plain tensor (a ``nn.Parameter`` too), ``t._local_tensor`` for a
        ``DTensor`` over a plain local tensor, ``.elem`` for an ``AsyncCollectiveTensor`` (also
        as a ``DTensor``'s local tensor; whoever reads its data calls :func:`wait_collective`
        first); otherwise :attr:`SkipReason.NO_STORAGE` (sparse, nested, meta) or
        :attr:`SkipReason.SUBCLASS` (any other tensor subclass).
    """
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return _plain(t)
    if t.is_nested or t.layout != torch.strided:  # jagged nested tensors are a subclass too
        return SkipReason.NO_STORAGE
    local = t._local_tensor if is_dtensor(t) else t
    if is_async_collective(local):
        local = local.elem
    if local is not t and (type(local) is torch.Tensor or type(local) is torch.nn.Parameter):
        return _plain(local)
    return SkipReason.SUBCLASS


_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"),
               torch.sparse_bsr: ("crow_indices", "col_indices"),
               torch.sparse_csc: ("ccol_indices", "row_indices"),
               torch.sparse_bsc: ("ccol_indices", "row_indices")}


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes ``t``'s data takes, read without touching a storage where there is none
    (sparse: values and indices; nested: its buffer; subclasses: their elements)."""
    try:
        if t.layout == torch.sparse_coo:
            return t._values().nbytes + t._indices().nbytes
        if t.layout in _COMPRESSED:
            return t.values().nbytes + sum(getattr(t, name)().nbytes
                                           for name in _COMPRESSED[t.layout])
        if t.is_nested:
            return t.values().nbytes if t.layout == torch.jagged else t.untyped_storage().nbytes()
        return t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError, AttributeError):  # an exotic layout: unknown size
        return 0


def state_tensors_local(tensors) -> list[torch.Tensor]:
    """The plain local tensors of model-state tensors (parameters, buffers), DTensors seen
    through; those without one plain storage (sparse, nested, other subclasses) are left out:
    they are never swapped, so nothing needs to be told apart from them."""
    out = []
    for t in tensors:
        local = local_of(t)
        if type(local) is not SkipReason and local.device.type != "meta":
            out.append(local)
    return out
