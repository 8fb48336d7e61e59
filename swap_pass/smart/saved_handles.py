"""What SmartSwap's pack hook hands autograd, and the storages it tracks.

* :class:`Slot`: one live activation storage, the aliases the handles keep of it, and its swap
  group once it left (see Note: [When a saved tensor may leave] in executor.py).
* :class:`Handle`: what autograd keeps for a tracked saved tensor (its alias, its plan position).
* :class:`MicroBatch`: one forward + backward of a step: its handles, the storages it tracks,
  its :class:`~swap_pass.smart.follower.Follower` and :class:`~swap_pass.smart.recorder.Recorder`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from swap_pass.runtime.ownership import outside_holders
from swap_pass.runtime.swap_tensors import SwapTensors
from swap_pass.smart.policy import SwapPolicy
from swap_pass.smart.profiler import DetailedProfile
from swap_pass.smart.reports import MicroBatchReport
from swap_pass.smart.saved_local import completed_alias, is_dtensor

if TYPE_CHECKING:
    from swap_pass.smart.follower import Follower
    from swap_pass.smart.recorder import Recorder

__all__ = ["Handle", "MicroBatch", "Slot", "alias_of", "check_version", "data_version"]


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
        return outside_holders(self.aliases) == 0  # Note: [Ownership rule] in runtime/ownership.py


class Handle:
    """What autograd keeps for a saved tensor we track.

    ``live`` is its pack order in its micro-batch (the profile's record index); ``index`` its
    position in the plan its micro-batch runs (-1: unmatched).
    """

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
    """A new tensor over ``t``'s storage that shares its version counter but not its lifetime
    (a waited ``AsyncCollectiveTensor``'s alias is marked waited too, see Note: [Saved
    AsyncCollectiveTensors] in saved_local.py)."""
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
