"""SmartSwap: adaptive swapping of saved activations under a memory budget, in eager mode.

Pieces (each usable alone): :mod:`~swap_pass.smart.profiler` (lightweight signature, detailed
profile), :mod:`~swap_pass.smart.stages` (warmup -> gen_policy -> stable),
:mod:`~swap_pass.smart.policy` (MRL, candidates, greedy choice), :mod:`~swap_pass.smart.simulator`
(stall and peak of a choice), :mod:`~swap_pass.smart.executor` (the saved-tensor hooks),
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
