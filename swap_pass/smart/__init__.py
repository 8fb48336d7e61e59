"""SmartSwap (experimental): adaptive swapping of saved activations under a memory budget, eager.

Eight modules, in the order a step meets them:

* :mod:`~swap_pass.smart.smart_swap`: :class:`SmartSwap`, its config, the step loop;
* :mod:`~swap_pass.smart.reports`: the stage machine (warmup -> gen_policy -> stable) and what
  each step did;
* :mod:`~swap_pass.smart.profiler`: the lightweight signature and the detailed profile;
* :mod:`~swap_pass.smart.executor`: the saved-tensor hooks and the copy clock;
* :mod:`~swap_pass.smart.saved`: what the pack hook hands autograd, and the plain local tensor of a
  saved tensor (or why it stays);
* :mod:`~swap_pass.smart.recorder`: recording a step's detailed profile;
* :mod:`~swap_pass.smart.follower`: following a plan, matching saved tensors to its entries;
* :mod:`~swap_pass.smart.policy`: candidates, the greedy choice under the budget, the simulator
  (stall and peak of a choice) and the plan cache (one plan per operator sequence seen).
"""

from __future__ import annotations

from swap_pass.smart.policy import (
    PlanCache,
    PolicyEntry,
    SimResult,
    SwapPolicy,
    gen_policy,
    replay_peak,
    simulate,
)
from swap_pass.smart.profiler import DetailedProfile, sequence_distance
from swap_pass.smart.reports import Stage, StageEvent
from swap_pass.smart.smart_swap import SmartSwap, SmartSwapConfig

__all__ = [
    "DetailedProfile",
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
