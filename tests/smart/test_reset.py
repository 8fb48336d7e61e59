"""``swap_pass.reset()`` inside ``with SmartSwap(...)`` clears counters and pending state only:
SmartSwap keeps its hooks, reaches its plan and swaps, exactly."""

from __future__ import annotations

import swap_pass
from swap_pass import SmartSwap, SmartSwapConfig
from tests.smart.helpers import Pair


def test_reset_before_every_step_keeps_smartswap_planning_and_swapping(device):
    pair = Pair(device)
    with SmartSwap(pair.model, memory_budget=0.25, config=SmartSwapConfig(min_swap_bytes=0)) \
            as smart:
        for _ in range(4):
            swap_pass.reset()  # as the README's snippets do before reading counters
            pair.step(smart)  # bitwise against the unswapped twin
        assert smart.stage == "stable" and smart.policy is not None
        assert swap_pass.swap_stats().swap_outs > 0
        assert "budget" in smart.policy.summary()


def test_reset_between_forward_and_backward_keeps_the_step_exact(device):
    pair = Pair(device)
    with SmartSwap(pair.model, memory_budget=0.25, config=SmartSwapConfig(min_swap_bytes=0)) \
            as smart:
        for _ in range(3):
            pair.step(smart)
        pair.step(smart, between=swap_pass.reset)  # restores what the forward swapped
        swap_pass.reset()
        pair.step(smart)
        assert swap_pass.swap_stats().swap_outs > 0
