"""Micro-batches in flight at once, in one process: the order in which the first stage of a
2-stage 1F1B pipeline runs its 4 micro-batches (F0 F1 B0 F2 B1 F3 B2 B3), without the pipeline.

Each micro-batch runs a plan made for its own saved tensors; when one begins, what the earlier
micro-batches still waiting for their backward keep on the device goes to the host (Note:
[Micro-batches in flight] in executor.py). Checked: every loss and gradient bitwise equal to the
same order without SmartSwap, the planned steps' resident saved bytes within ``memory_budget``
of the step's unswapped peak, bytes moved at the micro-batch boundaries, and none moved that way
when the micro-batches run one after another (gradient accumulation).
"""

from __future__ import annotations

import copy

import torch

from swap_pass import SmartSwap
from swap_pass.tools.models import make_batch

from .helpers import BATCH, SavedBytesCounter, no_hooks, tiny_model

FRACTION = 0.5
ONE_F_ONE_B = ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
SEQUENTIAL = ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def _run(model, order: list[str], step: int) -> tuple[list[torch.Tensor], int]:
    """``order``'s forwards and backwards on ``model``: the losses, the resident saved peak."""
    losses: dict[int, torch.Tensor] = {}
    with SavedBytesCounter(model) as counter:
        for op in order:
            mb = int(op[1])
            if op[0] == "F":
                ids, labels = make_batch(model.cfg, BATCH, 32, seed=10 * step + mb)
                losses[mb] = model(ids, labels)
            else:
                losses[mb].backward()
    return [losses[mb].detach() for mb in sorted(losses)], counter.peak


def _train(order: list[str]) -> tuple[list, list]:
    model = tiny_model()
    ref = copy.deepcopy(model)
    steps = []
    with SmartSwap(model, memory_budget=FRACTION) as smart:
        for step in range(4):
            with no_hooks():
                ref_losses, unswapped = _run(ref, order, step)
            losses, peak = _run(model, order, step)
            assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            stage = smart.stage.value
            smart.step()
            report = smart.last_report
            steps.append((stage, peak, unswapped, report.max_in_flight, report.evicted_bytes))
        plans = [plan.budget_bytes for plan in smart.plan_cache.plans()]
    return steps, plans


def test_overlapping_micro_batches_are_exact_and_within_the_step_budget():
    steps, plans = _train(ONE_F_ONE_B)
    # F2 and F3 each begin with one earlier micro-batch in flight
    assert [s[3] for s in steps] == [2] * 4, steps
    planned = [s for s in steps if s[0] == "stable"]
    assert len(planned) == 2, steps
    for _, peak, unswapped, _, evicted in planned:
        assert peak <= FRACTION * unswapped, (steps, plans)
        assert evicted > 0, steps
    assert len(plans) == 2, plans  # F0 F1 (two forwards, then a backward) and one forward


def test_micro_batches_one_after_another_move_nothing_at_their_boundaries():
    steps, _ = _train(SEQUENTIAL)
    assert [(s[3], s[4]) for s in steps] == [(1, 0)] * 4, steps
    for _, peak, unswapped, _, _ in [s for s in steps if s[0] == "stable"]:
        assert peak <= FRACTION * unswapped, steps
