"""Fuzzy matching of live saved tensors to a plan, and the signature distance."""

from __future__ import annotations

from swap_pass.smart.follower import OnlineMatcher
from swap_pass.smart.profiler import sequence_distance

PLAN = [10, 11, 12, 13, 14, 15, 16, 17]


def _match_all(live, window=4):
    m = OnlineMatcher(PLAN, window)
    return [m.match(k) for k in live]


def test_identical_sequence_matches_in_order():
    assert _match_all(PLAN) == list(range(len(PLAN)))


def test_inserted_key_stays_unmatched_and_the_rest_still_match():
    live = PLAN[:3] + [99] + PLAN[3:]
    assert _match_all(live) == [0, 1, 2, None, 3, 4, 5, 6, 7]


def test_removed_key_is_skipped():
    live = PLAN[:3] + PLAN[4:]
    assert _match_all(live) == [0, 1, 2, 4, 5, 6, 7]


def test_repeated_keys_match_the_next_occurrence_not_an_earlier_one():
    m = OnlineMatcher([1, 2, 1, 2], window=4)
    assert [m.match(k) for k in [1, 2, 1, 2]] == [0, 1, 2, 3]


def test_a_key_beyond_the_window_is_not_matched_and_the_streak_counts_misses():
    m = OnlineMatcher(PLAN, window=2)
    assert m.match(15) is None and m.streak == 1
    assert m.match(98) is None and m.streak == 2
    assert m.match(10) == 0 and m.streak == 0


def test_sequence_distance_small_for_one_edit_large_for_a_new_sequence():
    a = list(range(200))
    assert sequence_distance(a, a) == 0.0
    assert sequence_distance(a, a[:100] + [-1] + a[100:]) < 0.01
    assert sequence_distance(a, [x + 1000 for x in a]) == 1.0


def test_lightweight_profiler_and_smartswap_compute_the_same_keys():
    import torch

    from swap_pass import SmartSwap
    from swap_pass.tools.smart_bench import LightweightProfiler

    from .helpers import tiny_model

    model = tiny_model()
    ids = torch.randint(0, 256, (2, 8))
    with LightweightProfiler(model) as prof:
        model(ids, ids).backward()
    with SmartSwap(model, memory_budget=0) as smart:
        model(ids, ids).backward()
        smart.step()
    assert len(prof.keys) > 50 and smart.last_report.keys == prof.keys
    assert prof.step() == smart.last_report.signature
