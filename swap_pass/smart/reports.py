"""Where a SmartSwap step stands and what it did: the stage machine and the step reports."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swap_pass.smart.policy import SwapPolicy
    from swap_pass.smart.profiler import DetailedProfile

__all__ = ["MicroBatchReport", "Stage", "StageController", "StageEvent", "StepReport"]


# --- SmartSwap's stage machine: when to profile in detail, when to plan, when to run a plan -------
#     warmup --(warmup_steps done)--> gen_policy --(policy built)--> stable
#                                         ^                             |
#                                         +--(signature distance > threshold)
#     stable --(small change, distance <= threshold)--> stable   (absorbed by fuzzy matching)


class Stage(str, enum.Enum):
    """A SmartSwap stage; compares equal to its string value."""

    WARMUP = "warmup"
    GEN_POLICY = "gen_policy"
    STABLE = "stable"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class StageEvent:
    """One line of the stage log.

    Attributes:
        step: The step (0-based, counted by ``SmartSwap.step()``) that just ended.
        before: Stage during that step.
        after: Stage of the next step.
        reason: Why, in words (e.g. ``"signature changed: distance 0.71 > 0.10"``).
    """

    step: int
    before: Stage
    after: Stage
    reason: str


class StageController:
    """Explicit state machine over :class:`Stage`, with a readable log.

    Args:
        warmup_steps: Steps to spend in ``warmup`` before the first detailed profile.
        threshold: Signature distance (0..1) above which a stable plan is re-made.
    """

    def __init__(self, warmup_steps: int, threshold: float) -> None:
        self.stage = Stage.WARMUP if warmup_steps > 0 else Stage.GEN_POLICY
        self.warmup_steps = warmup_steps
        self.threshold = threshold
        self.log: list[StageEvent] = []
        self._steps_in_stage = 0

    def _move(self, step: int, after: Stage, reason: str) -> Stage:
        self.log.append(StageEvent(step, self.stage, after, reason))
        if after != self.stage:
            self._steps_in_stage = 0
        self.stage = after
        return after

    def end_step(self, step: int, *, policy_built: bool, distance: float | None) -> Stage:
        """Advance after step ``step``; return the stage of the next step.

        Args:
            step: Index of the step that ended.
            policy_built: A policy was generated from this step's detailed profile.
            distance: In ``stable``, the signature distance to the plan's sequence (``None``
                when the signature was identical).
        """
        self._steps_in_stage += 1
        if self.stage == Stage.WARMUP:
            if self._steps_in_stage >= self.warmup_steps:
                return self._move(step, Stage.GEN_POLICY,
                                  f"warmup done after {self.warmup_steps} step(s)")
            return self.stage
        if self.stage == Stage.GEN_POLICY:
            if policy_built:
                return self._move(step, Stage.STABLE, "policy generated from the detailed profile")
            return self.stage
        if distance is None:
            return self.stage
        if distance > self.threshold:
            return self._move(step, Stage.GEN_POLICY,
                              f"signature changed: distance {distance:.3f} > {self.threshold:.3f}")
        return self._move(step, Stage.STABLE,
                          f"small change absorbed: distance {distance:.3f} <= {self.threshold:.3f}")

    def note(self, step: int, reason: str) -> None:
        """Log an event of step ``step`` that keeps the stage (a plan cache hit or miss)."""
        self.log.append(StageEvent(step, self.stage, self.stage, reason))

    @property
    def replans(self) -> int:
        """How many times a stable plan was dropped for a new one."""
        return sum(1 for e in self.log if e.before == Stage.STABLE and e.after == Stage.GEN_POLICY)


# --- what a step did ------------------------------------------------------------------------------


@dataclasses.dataclass
class StepReport:
    """What one step did.

    Attributes:
        keys: Feature keys of the first micro-batch in forward order (the lightweight profile).
        signature: Hash of ``keys``.
        stage: The :class:`Stage` it ran in (a stable micro-batch may still have ``fell_back``).
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
        max_in_flight: Most micro-batches whose saved tensors autograd held at once (above 1 in
            a 1F1B pipeline schedule, say; see Note: [Micro-batches in flight] in executor.py).
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
