"""SmartSwap end to end on the Llama-style model: budget, exactness, re-planning, fuzzy matching.

Every run is compared with a deep copy of the same model trained without any hooks
(``torch.equal`` on the loss and every gradient). Resident saved bytes come from
:class:`SavedBytesCounter`, which reads storage sizes and never SmartSwap's bookkeeping.
"""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SmartSwap, SwapConfig
from swap_pass.smart import SmartSwapConfig, Stage
from swap_pass.tools.models import make_batch

from .helpers import BATCH, SEQ, Pair, SavedBytesCounter, no_hooks, tiny_model
from .helpers import unswapped_peak as _unswapped_peak


def test_budget_of_a_quarter_holds_and_gradients_are_bitwise_equal(device):
    pair = Pair(device)
    peak0 = _unswapped_peak(pair)
    budget = peak0 // 4
    config = SmartSwapConfig(swap=SwapConfig(use_streams=True))
    with SmartSwap(pair.model, memory_budget=budget, config=config) as smart:
        peaks = [pair.step(smart, seed=s).peak for s in range(5)]
        assert smart.stage == Stage.STABLE
        policy = smart.policy
    assert policy.feasible and policy.budget_bytes == budget
    assert policy.unswapped_peak == peak0  # the profile saw what the independent counter saw
    assert max(peaks) <= budget, (peaks, budget)
    assert peaks[-1] == policy.predicted_peak  # replayed prediction == measured, stable steps
    assert 0 < len(policy.swapped) < len(policy.candidates)  # a choice, not "swap everything"


def test_saved_storages_are_really_freed_after_forward(device):
    pair = Pair(device)
    with SmartSwap(pair.model, memory_budget=0.25) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        ids, labels = make_batch(pair.model.cfg, BATCH, SEQ, device=device)
        with SavedBytesCounter(pair.model) as counter:
            loss = pair.model(ids, labels)
            live = [ref() for ref in counter.storages.values()]
            freed = [s for s in live if s is not None and s.nbytes() == 0]
            assert len(freed) == len(smart.policy.swapped) > 0
            loss.backward()
        assert swap_pass.swap_stats().swap_ins >= len(freed)
        pair.model.zero_grad(set_to_none=True)
        smart.step()


@pytest.mark.slow
def test_without_a_plan_cache_fifty_steps_with_the_length_changing_every_ten_replan_each_time():
    pair = Pair()
    seqs = [12, 24, 16, 32, 20]
    config = SmartSwapConfig(plan_cache_size=0)
    with SmartSwap(pair.model, memory_budget=0.25, config=config) as smart:
        stable_peaks = []
        for step in range(50):
            stage, policy = smart.stage, smart.policy  # the plan in force for this step
            counter = pair.step(smart, seq=seqs[step // 10], seed=step)
            if stage == Stage.STABLE:  # change steps included: see Note: [Falling back mid-step]
                stable_peaks.append((step, counter.peak, policy.budget_bytes))
        log = smart.stage_log
    replans = [e.step for e in log if e.before == Stage.STABLE and e.after == Stage.GEN_POLICY]
    assert replans == [10, 20, 30, 40]
    assert all("signature changed" in e.reason for e in log
               if e.step in replans and e.after == "gen_policy")
    assert [e.step for e in log if e.after == Stage.STABLE] == [1, 11, 21, 31, 41]
    assert all(peak <= budget for _, peak, budget in stable_peaks), stable_peaks
    assert {step for step, _, _ in stable_peaks} >= {10, 20, 30, 40}


def _extra_op(module, args, output):
    return output * torch.ones_like(output)  # one more op that saves one tensor


def test_one_inserted_op_is_absorbed_by_fuzzy_matching_without_a_replan():
    pair = Pair()
    with SmartSwap(pair.model, memory_budget=0.25) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        swapped_before = smart.last_report.swapped_storages
        for m in (pair.model, pair.ref):
            m.layers[1].post_norm.register_forward_hook(_extra_op)
        for s in range(3, 6):
            pair.step(smart, seed=s)
        report = smart.last_report
    assert smart.replans == 0 and smart.stage == Stage.STABLE
    assert report.unmatched == 1 and not report.fell_back
    assert report.swapped_storages == swapped_before  # the plan still ran in full
    assert any("absorbed" in e.reason for e in smart.stage_log)


@pytest.mark.parametrize("cache", [8, 0], ids=["plan_cache", "no_cache"])
def test_a_large_change_replans(cache, device):
    pair = Pair(device)
    config = SmartSwapConfig(plan_cache_size=cache)
    with SmartSwap(pair.model, memory_budget=0.25, config=config) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        pair.step(smart, batch=4, seed=3)  # every activation shape grows: no plan fits
        assert smart.last_report.fell_back
        if cache:  # planned from the change step's own profile, no profiling step
            assert smart.stage == Stage.STABLE and smart.plan_cache.misses == 1
        else:
            assert smart.stage == Stage.GEN_POLICY and smart.replans == 1
            pair.step(smart, batch=4, seed=4)
        pair.step(smart, batch=4, seed=5)
        assert smart.stage == Stage.STABLE and smart.last_report.unmatched == 0
        assert not smart.last_report.fell_back


def test_a_scrambled_plan_costs_memory_never_data(device):
    """Random swap tags and random prefetch triggers: gradients stay bitwise equal."""
    import dataclasses
    import random

    pair = Pair(device)
    rng = random.Random(0)
    with SmartSwap(pair.model, memory_budget=0.25) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        for s in range(3, 6):
            policy = smart.policy
            entries = [dataclasses.replace(e, swap=rng.random() < 0.5) for e in policy.entries]
            n = len(entries)
            prefetch = {rng.randrange(n): rng.sample(range(n), 5) for _ in range(n // 3)}
            smart.policy = dataclasses.replace(policy, entries=entries, prefetch=prefetch)
            pair.step(smart, seed=s)  # the next step runs the scrambled plan
        assert smart.last_report.swapped_storages > 0 and smart.replans == 0


def test_with_full_recompute_the_checkpointed_inputs_are_swapped_exactly(device):
    pair = Pair(device, recompute=True)
    # the forward itself holds more than 0.25 of the unswapped peak: the warning says where
    with (pytest.warns(RuntimeWarning, match="memory_budget=0.25 .* cannot be met"),
          SmartSwap(pair.model, memory_budget=0.25) as smart):
        for s in range(4):
            pair.step(smart, seed=s)
        assert smart.stage == Stage.STABLE and smart.last_report.swapped_storages > 0


def test_host_cap_applies_and_keep_on_device_stays_exact():
    pair = Pair()
    swap = SwapConfig(max_host_bytes=64 * 1024, on_host_exhausted="keep_on_device")
    with pytest.warns(RuntimeWarning, match="host memory exhausted"):
        with SmartSwap(pair.model, memory_budget=0.25, config=swap) as smart:
            for s in range(3):
                pair.step(smart, seed=s)
    stats = swap_pass.swap_stats()
    assert stats.kept_on_device > 0 and stats.peak_host_bytes_in_use <= 64 * 1024


def _packed_by_smartswap(loss: torch.Tensor) -> bool:
    """Whether any tensor saved in ``loss``'s graph went through a saved-tensor pack hook."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                raw = getattr(node, name)
                if isinstance(raw, torch._C._autograd.SavedTensor) and raw.unpack_hook is not None:
                    return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def test_paused_leaves_another_models_saved_tensors_alone():
    pair, other = Pair(), tiny_model(seed=1)
    ids, labels = make_batch(other.cfg, BATCH, SEQ, seed=3)
    with no_hooks():
        ref = other(ids, labels)
    with SmartSwap(pair.model, memory_budget=0.25) as smart:
        for _ in range(4):
            with smart.paused():
                loss = other(ids, labels)
            assert not _packed_by_smartswap(loss)
            assert torch.equal(loss, ref)
            loss.backward()
            pair.step(smart)
        assert _packed_by_smartswap(other(ids, labels))  # on again after paused()
    with smart.paused():  # closed: nothing to pause
        pass


def test_paused_refuses_to_pop_hooks_entered_after_it():
    with SmartSwap(tiny_model(), memory_budget=0.25) as smart, no_hooks():
        with pytest.raises(RuntimeError, match="other saved-tensor hooks"):
            with smart.paused():
                pass
