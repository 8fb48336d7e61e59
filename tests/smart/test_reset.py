"""``swap_pass.reset()`` inside ``with SmartSwap(...)`` clears counters and pending state only:
SmartSwap keeps its hooks, reaches its plan and swaps, exactly."""

from __future__ import annotations

import torch

import swap_pass
from swap_pass import SmartSwap, SmartSwapConfig
from swap_pass.models import make_batch
from tests.smart.helpers import Pair, no_hooks


def test_reset_before_every_step_keeps_smartswap_planning_and_swapping():
    pair = Pair()
    with SmartSwap(pair.model, memory_budget=0.25, config=SmartSwapConfig(min_swap_bytes=0)) \
            as smart:
        for _ in range(4):
            swap_pass.reset()  # as the README's snippets do before reading counters
            pair.step(smart)  # bitwise against the unswapped twin
        assert smart.stage == "stable" and smart.policy is not None
        assert swap_pass.swap_stats().swap_outs > 0
        assert "budget" in smart.policy.summary()


def test_reset_between_forward_and_backward_keeps_the_step_exact():
    pair = Pair()
    with SmartSwap(pair.model, memory_budget=0.25, config=SmartSwapConfig(min_swap_bytes=0)) \
            as smart:
        for _ in range(3):
            pair.step(smart)
        ids, labels = make_batch(pair.model.cfg, 2, 32, seed=0)
        with no_hooks():
            ref_loss = pair.ref(ids, labels)
            ref_loss.backward()
        loss = pair.model(ids, labels)
        swap_pass.reset()  # restores what the forward swapped
        loss.backward()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(pair.model.parameters(), pair.ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        pair.model.zero_grad(set_to_none=True)
        pair.ref.zero_grad(set_to_none=True)
        smart.step()
        swap_pass.reset()
        pair.step(smart)
        assert swap_pass.swap_stats().swap_outs > 0
