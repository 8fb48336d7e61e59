"""What a SmartSwap step did: its per-step and per-micro-batch reports."""

from __future__ import annotations

import dataclasses
import types
import warnings

from swap_pass.smart.policy import SwapPolicy
from swap_pass.smart.profiler import DetailedProfile
from swap_pass.smart.stages import Stage

__all__ = ["MicroBatchReport", "StepReport"]

# The executor's former mode enum, by the stage each mode ran in: see __getattr__.
_EXEC_MODE = types.SimpleNamespace(CONSERVATIVE=Stage.WARMUP, DETAILED=Stage.GEN_POLICY,
                                   PLANNED=Stage.STABLE)


def __getattr__(name: str):
    """``ExecMode``, deprecated: the executor runs by :class:`Stage` (its members name the
    stages: ``CONSERVATIVE`` is ``Stage.WARMUP``, ``DETAILED`` ``Stage.GEN_POLICY``, ``PLANNED``
    ``Stage.STABLE``)."""
    if name == "ExecMode":
        warnings.warn(
            "swap_pass.smart: ExecMode is deprecated; the executor runs by "
            "swap_pass.smart.Stage (ExecMode.CONSERVATIVE is Stage.WARMUP, DETAILED is "
            "Stage.GEN_POLICY, PLANNED is Stage.STABLE) and StepReport.stage holds it.",
            DeprecationWarning, stacklevel=2)
        return _EXEC_MODE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class StepReport:
    """What one step did.

    Attributes:
        keys: Feature keys of the first micro-batch in forward order (the lightweight profile).
        signature: Hash of ``keys``.
        stage: The :class:`Stage` the step ran in (a stable micro-batch may still have
            fallen back: ``fell_back``).
        fell_back: A planned micro-batch switched to conservative after too many unmatched tensors.
        matched: Saved tensors matched to policy entries.
        unmatched: Saved tensors not matched (kept on the device).
        swapped_storages: Storages moved to the host.
        swapped_bytes: Their bytes.
        sync_restores: Unpacks that found their data still off the device (a stall).
        d2h_waits: Per device-to-host copy of a planned micro-batch: (logical layer it started
            in, logical layer whose start waited for it; the plan's group count for backward).
        profile: The detailed profile of the first micro-batch (``gen_policy`` steps, and
            ``stable`` steps that record), else None.
        micro_batches: Forward + backward passes in the step (gradient accumulation).
        units: Per micro-batch: :class:`MicroBatchReport`.
        max_in_flight: Most micro-batches whose saved tensors autograd held at once (above 1: a
            micro-batch's forward began before the backward of an earlier one had finished, as
            in a 1F1B pipeline schedule; see Note: [Micro-batches in flight] in executor.py).
        evicted_bytes: Bytes such earlier micro-batches kept on the device and that moved to
            the host when a later one began (also in ``swapped_bytes``).
    """

    keys: list[int]
    signature: int
    stage: Stage
    fell_back: bool = False
    matched: int = 0
    unmatched: int = 0
    swapped_storages: int = 0
    swapped_bytes: int = 0
    sync_restores: int = 0
    profile: DetailedProfile | None = None
    d2h_waits: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    micro_batches: int = 0
    units: list[MicroBatchReport] = dataclasses.field(default_factory=list)
    max_in_flight: int = 1
    evicted_bytes: int = 0

    @property
    def mode(self) -> Stage:
        """Deprecated: :attr:`stage`."""
        warnings.warn("swap_pass.smart.StepReport.mode is deprecated; read StepReport.stage "
                      "(the Stage the step ran in).", DeprecationWarning, stacklevel=2)
        return self.stage

    def __repr__(self) -> str:  # one line; ``keys`` and ``profile`` are in the attributes
        return (f"StepReport(stage={self.stage.value!r}, saved={len(self.keys)}, "
                f"matched={self.matched}, "
                f"unmatched={self.unmatched}, swapped_storages={self.swapped_storages}, "
                f"swapped_bytes={self.swapped_bytes}, sync_restores={self.sync_restores}, "
                f"fell_back={self.fell_back}, micro_batches={self.micro_batches}, "
                f"max_in_flight={self.max_in_flight})")


@dataclasses.dataclass
class MicroBatchReport:
    """What one forward + backward of a step did.

    Attributes:
        keys: Feature keys in forward order.
        profile: Its detailed profile, when the step recorded one.
        plan: The plan it ran to its end (None: conservative, or fell back).
        switched: It left the step's first plan for another cached plan (see
            Note: [Choosing a cached plan mid-step]).
        by_structure: The plan it ran was made for another length of the same structure.
        fell_back: It turned conservative after ``miss_limit`` unmatched tensors.
        in_flight: Micro-batches of the step whose saved tensors autograd held when it began,
            itself included.
    """

    keys: list[int]
    profile: DetailedProfile | None = None
    plan: SwapPolicy | None = None
    switched: bool = False
    by_structure: bool = False
    fell_back: bool = False
    in_flight: int = 1

    def __repr__(self) -> str:  # one line; ``keys`` and ``profile`` are in the attributes
        return (f"MicroBatchReport(saved={len(self.keys)}, plan={self.plan!r}, "
                f"switched={self.switched}, by_structure={self.by_structure}, "
                f"fell_back={self.fell_back}, in_flight={self.in_flight})")
