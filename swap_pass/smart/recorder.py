"""Recording a step for SmartSwap's policy: what is saved, in which order, and each storage's life.

A :class:`Recorder` fills one micro-batch's :class:`~swap_pass.smart.profiler.DetailedProfile`
from the executor's hooks, every event at a tick of :class:`Ticks`, so that the policy can
replay the step's memory curve for any swap choice. It only records.
"""

from __future__ import annotations

import weakref

import torch

from swap_pass.smart.profiler import DetailedProfile, SavedRecord, StorageLife

__all__ = ["Recorder", "Ticks"]


class Ticks:
    """SmartSwap's event clock: one tick per poll (pack, module exit), unpack and dropped storage.
    Lives as long as its executor; restarts at 0 every step."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0

    def advance(self) -> int:
        """The next tick (now the current one)."""
        self.now += 1
        return self.now


class Recorder:
    """Records one micro-batch into a :class:`DetailedProfile`, at the ticks of ``ticks``.

    Args:
        ticks: The executor's event clock.
    """

    def __init__(self, ticks: Ticks) -> None:
        self.profile = DetailedProfile()
        self._ticks = ticks

    # --- forward ------------------------------------------------------------------------------

    def add_storage(self, slot, nbytes: int) -> None:
        """A storage tracked from now (``slot``): its ordinal in the profile, its life opened;
        its drop is recorded when autograd lets go of the slot."""
        slot.ordinal = len(self.profile.storages)
        self.profile.storages.append(StorageLife(nbytes=nbytes, packed=self._ticks.now))
        weakref.finalize(slot, self._dropped, slot.ordinal)

    def saved(self, t: torch.Tensor, nbytes: int, op: str, fqn: str, key: int, cls: int,
              live: int, slot) -> None:
        """One pack: ``t`` saved ``live``-th in the micro-batch (``slot``: its tracked storage,
        or None for model state and what cannot move)."""
        ordinal = slot.ordinal if slot is not None else -1
        profile = self.profile
        profile.records.append(SavedRecord(
            index=live, op=op, fqn=fqn, dtype=t.dtype, shape=tuple(t.shape), nbytes=nbytes,
            key=key, storage=ordinal, cls=cls, tick=self._ticks.now))
        if slot is not None:
            profile.storages[ordinal].entries.append(live)

    def released(self, slot) -> None:
        """From this tick ``slot``'s storage could be (or is) off the device."""
        life = self.profile.storages[slot.ordinal]
        if life.released is None:
            life.released = self._ticks.now

    def _dropped(self, ordinal: int) -> None:
        tick = self._ticks.advance()
        life = self.profile.storages[ordinal]
        if life.dropped is None:
            life.dropped = tick

    # --- backward -----------------------------------------------------------------------------

    def backward_started(self) -> None:
        """The micro-batch's backward starts at the next tick."""
        if self.profile.backward_tick is None:
            self.profile.backward_tick = self._ticks.now + 1

    def unpacked(self, live: int, slot) -> None:
        """An unpack of the ``live``-th saved tensor (``slot``: its tracked storage, or None)."""
        profile, tick = self.profile, self._ticks.now
        profile.unpack_ticks.append((tick, live))
        rec = profile.records[live]
        if rec.bwd_order < 0:
            rec.bwd_order = len(profile.unpack_ticks) - 1
        if slot is not None and profile.storages[slot.ordinal].unpacked is None:
            profile.storages[slot.ordinal].unpacked = tick

    # --- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """The micro-batch ended at this tick."""
        self.profile.end_tick = self._ticks.now

    def timed(self, step_s: float, transfer_s: float) -> None:
        """The micro-batch's share of the step's wall time and of its copies' time."""
        self.profile.step_s = step_s
        self.profile.transfer_s = transfer_s
