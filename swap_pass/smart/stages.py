"""SmartSwap's stage machine: when to profile in detail, when to plan, when to run a plan.

::

    warmup --(warmup_steps done)--> gen_policy --(policy built)--> stable
                                        ^                             |
                                        +--(signature distance > threshold)
    stable --(small change, distance <= threshold)--> stable   (absorbed by fuzzy matching)

``warmup`` and ``gen_policy`` steps run the conservative executor (every eligible saved tensor
leaves once nothing else holds it), so memory stays bounded while no plan exists.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Stage", "StageController", "StageEvent"]


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
