"""SmartSwap: adaptive swapping of saved activations under a memory budget, in eager mode.

Pieces (each usable alone): :mod:`~swap_pass.smart.profiler` (lightweight signature, detailed
profile), :mod:`~swap_pass.smart.stages` (warmup -> gen_policy -> stable),
:mod:`~swap_pass.smart.policy` (MRL, candidates, greedy choice), :mod:`~swap_pass.smart.simulator`
(stall and peak of a choice), :mod:`~swap_pass.smart.executor` (the saved-tensor hooks; with
:mod:`~swap_pass.smart.recorder` (recording a step), :mod:`~swap_pass.smart.follower`
(following a plan), :mod:`~swap_pass.smart.saved_handles`, :mod:`~swap_pass.smart.matcher`,
:mod:`~swap_pass.smart.reports` and :mod:`~swap_pass.smart.bandwidth`),
:mod:`~swap_pass.smart.saved_local` (the plain local tensor of a saved tensor, or why it stays),
:mod:`~swap_pass.smart.plan_cache` (one plan per operator sequence seen).
"""

from __future__ import annotations

from swap_pass.smart.plan_cache import PlanCache
from swap_pass.smart.policy import PolicyEntry, SwapPolicy, gen_policy, replay_peak
from swap_pass.smart.profiler import DetailedProfile, LightweightProfiler, sequence_distance
from swap_pass.smart.simulator import SimResult, simulate
from swap_pass.smart.smart_swap import SmartSwap, SmartSwapConfig
from swap_pass.smart.stages import Stage, StageEvent

__all__ = [
    "DetailedProfile",
    "LightweightProfiler",
    "PlanCache",
    "PolicyEntry",
    "SimResult",
    "SmartSwap",
    "SmartSwapConfig",
    "Stage",
    "StageEvent",
    "SwapPolicy",
    "gen_policy",
    "replay_peak",
    "sequence_distance",
    "simulate",
]
