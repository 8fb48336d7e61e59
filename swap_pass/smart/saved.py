"""What SmartSwap's pack hook hands autograd (:class:`Handle`), the storages it tracks
(:class:`Slot`) per :class:`MicroBatch`, and the plain local tensor behind a saved tensor."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from swap_pass.runtime.freeing import is_async_collective, is_dtensor, outside_holders
from swap_pass.runtime.group import SwapTensors
from swap_pass.runtime.stats import SkipReason
from swap_pass.smart.reports import MicroBatchReport

if TYPE_CHECKING:
    from swap_pass.smart.follower import Follower
    from swap_pass.smart.policy import SwapPolicy
    from swap_pass.smart.profiler import DetailedProfile
    from swap_pass.smart.recorder import Recorder

__all__ = ["Handle", "MicroBatch", "Slot", "alias_of", "check_version", "completed_alias",
           "data_version", "is_async_collective", "is_dtensor", "local_of", "state_tensors_local",
           "storage_nbytes", "wait_collective"]


# --- The plain local tensor behind a saved tensor, or why SmartSwap must keep it where it is ------
# SmartSwap frees and restores whole storages: it needs one plain strided tensor over one storage,
# found by :func:`local_of` from type and layout alone, before anything reads a storage (a sparse,
# nested or meta tensor's ``untyped_storage()`` raises or names only part of the data).
#
# Note: [Saved DTensors]
#     A saved ``DTensor`` holds its local tensor; its ``detach()`` is a new ``DTensor`` over a
#     new local alias of the same storage (same version counter). SmartSwap gives autograd that
#     wrapper and counts holders on the local alias: an activation's local tensor is held by
#     nobody but the forward's wrapper, so once the forward let that go only our alias is left.
#     ``DTensor`` parameters (FSDP2 shards, TP weights) are recognized by their local tensors'
#     storages: model state, never moved.
#
# Note: [Saved AsyncCollectiveTensors]
#     A classic tensor-parallel plan (``RowwiseParallel()``, default ``use_local_output``) hands
#     the next module an ``AsyncCollectiveTensor``: a collective's output whose first non-view op
#     waits (``trigger_wait()``: ``wait_tensor`` on the current stream, once). An op saving it
#     saves the wrapper, and the pack hook runs right before that op's kernel, which would wait
#     anyway; so the pack waits then, on the compute stream, before anything reads or copies
#     ``.elem``: the copy to the host follows the collective (on an accelerator its stream waits
#     on an event recorded after the wait). Autograd gets ``t.detach()`` (a view op: no wait)
#     over a new alias of ``.elem``, marked completed like ``t``: its backward readers read the
#     restored storage and wait for nothing. Likewise for a ``DTensor`` over one. The eager path
#     does the same for layer inputs (Note: [Swapping through the local tensor] in
#     ``swap_pass/runtime/freeing.py``); ``tests/smart/test_distributed.py`` (``tp-classic``)
#     checks saved ones are freed and training is bitwise exact.


def _collective_of(t: torch.Tensor) -> torch.Tensor | None:
    """The ``AsyncCollectiveTensor`` holding ``t``'s data: ``t``, or a ``DTensor``'s local one."""
    if type(t) is torch.Tensor:  # the common case, before the subclass lookups
        return None
    if is_dtensor(t):
        t = t._local_tensor
    return t if is_async_collective(t) else None


def wait_collective(t: torch.Tensor) -> None:
    """Wait on the current stream, as a first reader would, for the collective behind ``t`` (an
    ``AsyncCollectiveTensor`` or a ``DTensor`` over one); Note: [Saved AsyncCollectiveTensors]."""
    act = _collective_of(t)
    if act is not None:
        act.trigger_wait()


def completed_alias(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, its ``AsyncCollectiveTensor`` (``t`` or a ``DTensor``'s local one) marked
    completed when ``t``'s is: the alias of a waited result waits for nothing again."""
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


# --- what the pack hook hands autograd ------------------------------------------------------------


class Slot:
    """One live activation storage and the aliases our handles keep of it."""

    __slots__ = ("aliases", "group", "swap", "ordinal", "order", "issued", "due", "__weakref__")

    def __init__(self, swap: bool, ordinal: int) -> None:
        self.aliases: list[torch.Tensor] = []
        self.group: SwapTensors | None = None
        self.swap = swap
        self.ordinal = ordinal
        self.order = -1
        self.issued = self.due = 0  # logical layers its device-to-host copy started / is waited in

    def releasable(self) -> bool:
        """True when nothing but our aliases holds the storage
        (see Note: [When a saved tensor may leave])."""
        return outside_holders(self.aliases) == 0  # Note: [Ownership rule] in runtime/freeing.py


class Handle:
    """What autograd keeps for a saved tensor we track: ``live`` is its pack order in its
    micro-batch (the profile's record index), ``index`` its plan position (-1: unmatched)."""

    __slots__ = ("slot", "tensor", "index", "live", "unit", "version", "__weakref__")

    def __init__(self, slot: Slot | None, tensor: torch.Tensor, index: int, live: int,
                 unit: MicroBatch) -> None:
        self.slot, self.tensor, self.index, self.live, self.unit = slot, tensor, index, live, unit
        self.version = data_version(tensor)

    @property
    def planned(self) -> bool:
        return self.index >= 0 and self.unit.policy is not None


class MicroBatch:
    """State of one forward + backward of a step: what it saved and tracks, and how it decides.

    Args:
        follower: Runs the step's plan over this micro-batch (stable steps), or None
            (conservative: every eligible activation leaves).
        recorder: Records its :class:`DetailedProfile`, or None.
    """

    def __init__(self, follower: Follower | None, recorder: Recorder | None) -> None:
        self.follower = follower
        self.recorder = recorder
        self.report = MicroBatchReport(keys=[], profile=recorder.profile if recorder else None)
        self.classes: list[int] = []  # structure keys (shape-free), forward order
        self.handles: list[weakref.ref | None] = []  # per live index
        self.released: list[weakref.ref] = []  # swapped slots in release order
        self.slots: dict[int, weakref.ref] = {}  # storage _cdata -> slot
        self.pending: list[weakref.ref] = []  # slots waiting for their last holder to let go
        self.backward = False  # its backward has started

    @property
    def profile(self) -> DetailedProfile | None:
        return self.report.profile

    @property
    def policy(self) -> SwapPolicy | None:
        """The plan it runs (or ran before falling back), or None."""
        return self.follower.policy if self.follower is not None else None

    @property
    def following(self) -> bool:
        """True while it follows a plan (a stable step that has not fallen back)."""
        return self.follower is not None and not self.follower.fell_back

    @property
    def group(self) -> int:
        """Logical layer of the plan the forward is in (0 without a plan)."""
        return self.follower.group if self.follower is not None else 0

    def holds_saved(self) -> bool:
        """True while autograd still holds a tensor this micro-batch saved through a handle."""
        return any(ref is not None and ref() is not None for ref in self.handles)


def alias_of(t: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``t``'s storage sharing its version counter, not its lifetime
    (:func:`completed_alias`)."""
    return completed_alias(t)


def data_version(t: torch.Tensor) -> int:
    """The version counter of ``t``'s data (a DTensor's in-place ops bump its local tensor's)."""
    if type(t) is torch.Tensor:  # the common case, before the subclass lookup
        return t._version
    return t._local_tensor._version if is_dtensor(t) else t._version


def check_version(handle: Handle) -> None:
    # Note: autograd skips its own version check for tensors saved through hooks; the alias
    # shares the saved tensor's version counter, so an in-place write is still caught here.
    if data_version(handle.tensor) != handle.version:
        t = handle.tensor
        raise RuntimeError(
            f"swap_pass.SmartSwap: a tensor saved for backward (shape {tuple(t.shape)}, {t.dtype}) "
            f"was modified by an inplace operation after it was saved (version {handle.version} -> "
            f"{data_version(t)}). A saved tensor must not be written before backward; "
            "clone it first."
        )
