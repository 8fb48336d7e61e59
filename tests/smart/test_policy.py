"""The policy generator on a real detailed profile of the Llama-style model."""

from __future__ import annotations

import pytest

from swap_pass import SmartSwap
from swap_pass.smart.policy import (
    candidate_list,
    gen_policy,
    memory_reduction_list,
    prefetch_ticks,
    replay_peak,
)
from swap_pass.tools.models import make_batch

from .helpers import tiny_model


@pytest.fixture(scope="module")
def profile():
    model = tiny_model()
    ids, labels = make_batch(model.cfg, 2, 16)
    with SmartSwap(model, memory_budget=0.25) as smart:
        for _ in range(2):  # warmup, then the detailed (gen_policy) step
            model(ids, labels).backward()
            smart.step()
    return smart.last_profile


def test_profile_holds_every_feature_the_policy_needs(profile):
    assert profile.records and profile.storages and profile.step_s > 0
    r = profile.records[0]
    assert r.op and r.fqn == "embed" and r.nbytes > 0
    assert {rec.fqn.split(".")[0] for rec in profile.records} >= {"embed", "layers", "lm_head"}
    orders = sorted(rec.bwd_order for rec in profile.records if rec.bwd_order >= 0)
    assert orders == sorted(set(orders))  # backward use order is a ranking
    for life in profile.storages:
        assert life.packed < (life.released or 10**9)
        assert life.unpacked is None or life.unpacked >= profile.backward_tick


def test_candidates_leave_in_forward_and_return_in_backward(profile):
    cands = candidate_list(profile, 0)
    assert cands
    for c in cands:
        life = profile.storages[c]
        assert life.released < profile.backward_tick <= life.unpacked
    big = candidate_list(profile, 10**9)
    assert big == []


def test_no_swap_replay_is_the_saved_peak_and_swapping_all_is_lower(profile):
    peak0, _ = replay_peak(profile, set(), 0, 8)
    assert peak0 == profile.saved_bytes()  # all activations alive at the end of forward
    peak_all, _ = replay_peak(profile, set(candidate_list(profile, 0)), 0, 8)
    assert peak_all < peak0 / 4


def test_mrl_marks_where_the_curve_passes_the_budget(profile):
    peak0, _ = replay_peak(profile, set(), 0, 8)
    assert memory_reduction_list(profile, peak0) == []
    runs = memory_reduction_list(profile, peak0 // 2)
    assert runs and max(excess for _, _, excess in runs) == peak0 - peak0 // 2


def test_budget_above_the_peak_swaps_nothing(profile):
    policy = gen_policy(profile, profile.saved_bytes(), num_groups=4)
    assert policy.swapped == [] and policy.feasible and policy.prefetch == {}


def test_quarter_budget_is_met_by_a_strict_subset(profile):
    budget = profile.saved_bytes() // 4
    policy = gen_policy(profile, budget, num_groups=8)
    assert policy.feasible and policy.predicted_peak <= budget
    assert 0 < len(policy.swapped) < len(policy.candidates)
    assert (replay_peak(profile, set(policy.swapped), policy.prefetch_depth, 8)[0]
            == policy.predicted_peak)
    assert "within budget" in policy.summary()


def test_impossible_budget_is_reported_not_hidden(profile):
    policy = gen_policy(profile, 0, num_groups=8)
    assert not policy.feasible and policy.predicted_peak > 0
    assert "OVER budget" in policy.summary()


def test_stall_prediction_follows_the_bandwidth(profile):
    budget = profile.saved_bytes() // 2
    fast = gen_policy(profile, budget, d2h_bandwidth=1e15, h2d_bandwidth=1e15)
    slow = gen_policy(profile, budget, d2h_bandwidth=1e3, h2d_bandwidth=1e3)
    assert fast.predicted.stall_s == pytest.approx(0.0, abs=1e-9)
    assert slow.predicted.stall_s > 0  # 1 kB/s cannot be hidden: the prediction says so


def test_prefetch_triggers_come_before_the_first_read(profile):
    for depth in (0, 1, 3):
        for ordinal, (tick, _) in prefetch_ticks(profile, depth, 8).items():
            assert tick <= profile.storages[ordinal].unpacked
