"""SmartSwap on changing workloads: the plan cache, one structure at many lengths, gradient
accumulation, copies that overlap a logical layer, and the limits it states.

Every step is checked against an unswapped twin (``torch.equal`` on the loss and every gradient,
see :class:`~tests.smart.helpers.Pair`); peaks come from the independent counter.
"""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch

import swap_pass
from swap_pass import SmartSwap
from swap_pass.smart import SmartSwapConfig, Stage
from swap_pass.testing import accelerator as device_knobs
from swap_pass.tools.models import make_batch
from swap_pass.tools.smart_bench import length_schedule, step_kind
from tests.conftest import on_test_accelerator

from .helpers import BATCH, Pair, SavedBytesCounter, no_hooks, tiny_model, unswapped_peak

FRACTION = 0.25


def _run(pair: Pair, smart: SmartSwap, seqs: list[int], budgets: dict[int, int]) -> list[tuple]:
    """Step through ``seqs``; per step (seq, kind, peak, budget of that length)."""
    out = []
    for step, n in enumerate(seqs):
        stage = smart.stage
        counter = pair.step(smart, seq=n, seed=step)
        out.append((n, step_kind(stage, smart.last_report), counter.peak, budgets[n]))
    return out


def _budgets(pair: Pair, seqs) -> dict[int, int]:
    return {n: int(FRACTION * unswapped_peak(pair, seq=n)) for n in set(seqs)}


def test_a_return_to_a_seen_shape_runs_its_cached_plan_on_its_first_step(device):
    pair = Pair(device)
    seqs = [32, 32, 32, 16, 16, 16, 32]
    budgets = _budgets(pair, seqs)
    with SmartSwap(pair.model, memory_budget=FRACTION) as smart:
        steps = _run(pair, smart, seqs, budgets)
        report, policy = smart.last_report, smart.policy
        log, cache = smart.stage_log, smart.plan_cache
    n, kind, peak, budget = steps[-1]
    assert kind == "planned" and report.unmatched == 0, steps
    assert peak <= budget and policy.budget_bytes == budget  # the fraction applied per shape
    assert any(e.step == 6 and "plan cache hit" in e.reason for e in log), log
    assert [k for _, k, _, _ in steps].count("profiling") == 1 and smart.replans == 0
    assert cache.hits >= 1 and cache.misses == 1 and cache.evictions == 0 and len(cache) == 2
    assert swap_pass.swap_stats().swap_outs > 0


def test_the_cache_is_bounded_least_recently_used_first_out():
    pair = Pair()
    seqs = [32, 32, 32, 16, 16, 24, 24, 32]
    config, budgets = SmartSwapConfig(plan_cache_size=2), _budgets(pair, seqs)
    with SmartSwap(pair.model, memory_budget=FRACTION, config=config) as smart:
        steps = _run(pair, smart, seqs, budgets)
        cache = smart.plan_cache
    assert len(cache) == 2 and cache.evictions == 2  # 32 left when 24 came, 16 when 32 came back
    assert steps[-1][1] == "conservative"  # nothing planned is as long as 32 any more


def test_a_new_length_inside_the_seen_range_runs_planned_on_its_first_step():
    pair = Pair()
    seqs = [32, 32, 32, 16, 16, 24]
    budgets = _budgets(pair, seqs)
    with SmartSwap(pair.model, memory_budget=FRACTION) as smart:
        steps = _run(pair, smart, seqs, budgets)
        derived = smart.plan_cache.derived
    assert [k for _, k, _, _ in steps[3:]] == ["planned"] * 3, steps
    assert derived == 2  # 16 and 24 both ran the plan made for 32 on their first step
    assert all(peak <= budget for _, _, peak, budget in steps[3:]), steps


def _schedule() -> list[int]:
    return length_schedule((16, 20, 24, 28, 32), 50, seed=0)


def _expected_conservative(seqs: list[int]) -> int:
    """Warmup, plus each first step of a length longer than every length seen before it."""
    longest, n = seqs[0], 1
    for s in seqs[1:]:
        n += s > longest
        longest = max(longest, s)
    return n


@pytest.mark.slow
def test_fifty_steps_of_lengths_drawn_from_five_values_profile_once():
    pair = Pair()
    seqs = _schedule()
    budgets = _budgets(pair, seqs)
    with SmartSwap(pair.model, memory_budget=FRACTION) as smart:
        steps = _run(pair, smart, seqs, budgets)
    kinds = [k for _, k, _, _ in steps]
    counts = {k: kinds.count(k) for k in ("planned", "conservative", "profiling")}
    assert _expected_conservative(seqs) == 2
    assert counts == {"planned": 47, "conservative": 2, "profiling": 1}, (counts, seqs)
    over = [(i, s) for i, s in enumerate(steps) if s[1] == "planned" and s[2] > s[3]]
    assert not over, over
    assert smart.replans == 0


# --- gradient accumulation ------------------------------------------------------------------


def _micro_batch(model, ref, ids, labels) -> int:
    """One forward + backward on both; returns how many saved storages were freed after forward."""
    with no_hooks():
        ref(ids, labels).backward()
    with SavedBytesCounter(model) as counter:
        loss = model(ids, labels)
        live = [r() for r in counter.storages.values()]
        freed = sum(1 for s in live if s is not None and s.nbytes() == 0)
        del live
        loss.backward()
    return freed


def test_every_micro_batch_of_an_accumulation_step_is_planned_and_exact(device):
    model = tiny_model().to(device)
    ref = copy.deepcopy(model)
    freed = []
    with SmartSwap(model, memory_budget=FRACTION) as smart:
        for step in range(4):
            for mb in range(3):
                ids, labels = make_batch(model.cfg, BATCH, 32, seed=10 * step + mb,
                                         device=device)
                freed.append(_micro_batch(model, ref, ids, labels))
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            stage = smart.stage
            smart.step()
        report, policy = smart.last_report, smart.policy
    assert freed[-3:] == [len(policy.swapped)] * 3 and freed[-1] > 0, freed
    assert stage == Stage.STABLE and report.micro_batches == 3 and not report.fell_back
    assert len(policy.keys) == len(report.keys)  # the plan covers one micro-batch


# --- overlap ------------------------------------------------------------------------------------


def _freed_group_per_storage(model, policy, ids, labels) -> dict[int, tuple[int, int]]:
    """For each storage freed during forward: (group it was saved in, group when it was freed)."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    saved: list[tuple[weakref.ref, int]] = []
    freed_at: dict[int, tuple[int, int]] = {}

    def pack(t):
        i = len(saved)
        group = policy.entries[min(i, len(policy.entries) - 1)].group
        for j, (ref, g) in enumerate(saved):
            s = ref()
            if j not in freed_at and s is not None and s.nbytes() == 0:
                freed_at[j] = (g, group)
        saved.append((weakref.ref(t.untyped_storage()), group))
        return outer[0](t)

    with torch.autograd.graph.saved_tensors_hooks(pack, outer[1]):
        loss = model(ids, labels)
    loss.backward()
    return freed_at


def test_device_to_host_copies_are_waited_for_a_logical_layer_later(device):
    pair = Pair(device)
    with SmartSwap(pair.model, memory_budget=FRACTION) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        ids, labels = make_batch(pair.model.cfg, BATCH, 32, seed=3, device=device)
        freed = _freed_group_per_storage(pair.model, smart.policy, ids, labels)
        pair.model.zero_grad(set_to_none=True)
        smart.step()
        policy = smart.policy
    assert len(freed) >= len(policy.swapped) // 2 > 0, freed
    assert all(at > saved for saved, at in freed.values()), freed
    assert policy.overlap_groups >= 1


# --- limits ---------------------------------------------------------------------------------------


def test_a_nested_smartswap_is_refused_with_a_clear_error_and_the_outer_one_keeps_working():
    outer_model, inner_model = tiny_model(), tiny_model(seed=1)
    ids, labels = make_batch(outer_model.cfg, BATCH, 16)
    with SmartSwap(outer_model, memory_budget=0) as outer:
        with pytest.raises(RuntimeError, match=r"swap_pass\.SmartSwap: .*inside another SmartSwap"):
            SmartSwap(inner_model, memory_budget=0).__enter__()
        outer_model(ids, labels).backward()
        outer.step()
    assert swap_pass.swap_stats().swap_outs > 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_an_unreachable_budget_warns_once_with_the_best_reachable_peak():
    pair = Pair()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SmartSwap(pair.model, memory_budget=1024) as smart:
            for s, n in enumerate([32, 32, 32, 16, 16]):
                pair.step(smart, seq=n, seed=s)
            policy = smart.policy
    ours = [w for w in caught if "cannot be met" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert not policy.feasible and smart.plan_cache.misses == 1
    assert "swap_pass.SmartSwap: memory_budget=1024 B cannot be met" in str(ours[0].message)
    assert "best reachable peak" in str(ours[0].message)


def _open_copies_out() -> int:
    """Copies out queued on the test accelerator that nobody waited for yet (with copies held
    until a wait, those not run yet)."""
    return sum(1 for w in device_knobs.copy_windows()
               if w.direction == "d2h" and w.closed_by == "open")


def _sampling_hooks(policy, samples: list):
    """Saved-tensor hooks over SmartSwap's: at each pack, (its logical layer, copies out still
    queued)."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(t):
        group = policy.entries[min(len(samples), len(policy.entries) - 1)].group
        samples.append((group, _open_copies_out()))
        return outer[0](t)

    return torch.autograd.graph.saved_tensors_hooks(pack, outer[1])


@on_test_accelerator
def test_copies_out_stay_queued_a_whole_logical_layer_and_grads_stay_exact(swaptest_held):
    """On the test accelerator, with copies held until someone waits for them: each logical
    layer's copies out are still queued all through the next one."""
    pair = Pair(swaptest_held)
    samples: list[tuple[int, int]] = []
    with SmartSwap(pair.model, memory_budget=0.5) as smart:
        for s in range(3):
            pair.step(smart, seed=s)  # bitwise equal to the twin
        policy = smart.policy
        device_knobs.record_copy_windows(True)
        try:
            with _sampling_hooks(policy, samples):
                pair.step(smart, seed=3)
        finally:
            device_knobs.record_copy_windows(False)
        report = smart.last_report
    assert policy.overlap_groups == 2 and not report.fell_back
    waits = report.d2h_waits
    assert len(waits) == report.swapped_storages > 0
    assert all(at - started >= 2 for started, at in waits), waits  # a whole layer in between
    for g in range(policy.num_groups - 1):  # layer g's copies are still queued all through g + 1
        started = sum(1 for s, _ in waits if s == g)
        assert min(n for grp, n in samples if grp == g + 1) >= started, (g, samples)
    assert report.sync_restores == 0 and policy.prefetch_depth >= 1  # every copy back prefetched
