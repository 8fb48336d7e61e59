"""The plain local tensor behind a saved tensor, or why SmartSwap must keep it where it is.

SmartSwap frees and restores whole storages. That needs one plain strided tensor over one
storage; what autograd saves may be something else:

* a ``DTensor`` (tensor parallel activations, FSDP2 and TP parameters): a wrapper whose data is
  its ``._local_tensor``, a plain tensor on this rank. SmartSwap swaps that local tensor and
  hands autograd the wrapper back (see Note: [Saved DTensors]);
* sparse (COO, CSR, ...), nested (strided or jagged) and meta tensors: no single plain storage
  (``untyped_storage()`` raises or names only part of the data): kept, ``no_storage``;
* any other tensor subclass (a quantized weight, ``TwoTensor``, an ``AsyncCollectiveTensor``
  not yet waited for): its data cannot be reached as one plain tensor: kept, ``subclass``.

This is decided from the tensor's type and layout alone, before anything reads a storage.

Note: [Saved DTensors]
    A ``DTensor`` saved for backward holds its local tensor; a ``detach()`` of it is a new
    ``DTensor`` over a new local alias of the same storage (sharing the version counter). SmartSwap
    keeps that detached wrapper for autograd and counts the storage's holders on the local alias:
    the local tensor of an activation is an activation like any plain one (nobody but the wrapper
    the forward made holds it), and once the forward let the wrapper go, only our alias is left.
    Parameters that are ``DTensor`` s (FSDP2 shards, TP weights) are recognized through their
    local tensors' storages: they are model state and never move.
"""

from __future__ import annotations

import sys

import torch

from swap_pass.runtime.skips import SkipReason

__all__ = ["is_dtensor", "local_of", "state_tensors_local", "storage_nbytes"]


def _dtensor_type() -> type | None:
    """``DTensor``'s class once ``torch.distributed.tensor`` is imported; else None (no
    DTensor can exist, and importing it here would cost every model)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a parameter one too)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def _plain(t: torch.Tensor) -> torch.Tensor | SkipReason:
    if t.layout != torch.strided or t.is_nested or t.is_meta:
        return SkipReason.NO_STORAGE
    return t


def local_of(t: torch.Tensor) -> torch.Tensor | SkipReason:
    """The plain strided tensor whose storage holds ``t``'s data, or why there is none.

    Returns:
        ``t`` itself for a plain tensor (a ``nn.Parameter`` too), ``t._local_tensor`` for a
        ``DTensor`` over a plain local tensor; otherwise :attr:`SkipReason.NO_STORAGE` (sparse,
        nested, meta) or :attr:`SkipReason.SUBCLASS` (any other tensor subclass).
    """
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return _plain(t)
    if t.is_nested or t.layout != torch.strided:  # jagged nested tensors are a subclass too
        return SkipReason.NO_STORAGE
    if is_dtensor(t):
        local = t._local_tensor
        if type(local) is torch.Tensor or type(local) is torch.nn.Parameter:
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
