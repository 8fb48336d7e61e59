"""The simulator alone: hand-checked stalls and peaks for small cases."""

from __future__ import annotations

import math

import pytest

from swap_pass.smart.policy import simulate

GB = 1e9


def test_no_swap_has_no_stall_and_peak_is_all_saved_bytes():
    r = simulate([1.0] * 4, [2.0] * 4, [10, 20, 30, 40], [0] * 4, d2h_bandwidth=GB,
                 h2d_bandwidth=GB)
    assert r.stall_s == 0.0
    assert r.peak_bytes == 100
    assert r.step_s == pytest.approx(12.0)


def test_swap_lowers_peak_and_fast_copies_do_not_stall():
    kept = simulate([1.0] * 4, [2.0] * 4, [0, 0, 0, 40], [10, 20, 30, 0], d2h_bandwidth=GB,
                    h2d_bandwidth=GB, prefetch_depth=1)
    assert kept.stall_s == pytest.approx(0.0, abs=1e-6)
    # forward: group i's swapped bytes are freed at the end of group i+1, so at the end of
    # group 3 its 40 resident bytes meet group 2's 30 not yet freed: 70; backward at depth 1
    # brings group 2 back while group 3 is still resident: 40 + 30 = 70 again
    assert kept.peak_bytes == 70


def test_slow_h2d_without_prefetch_stalls_by_the_copy_time():
    # one swapped group of 100 bytes at 100 B/s: its copy back takes 1 s; depth 0 issues it
    # when its own backward starts, so backward waits the whole second
    r = simulate([1.0, 1.0], [1.0, 1.0], [0, 0], [100, 0], d2h_bandwidth=1e12, h2d_bandwidth=100.0,
                 prefetch_depth=0)
    assert r.backward_stall_s == pytest.approx(1.0)
    assert r.forward_stall_s == pytest.approx(0.0, abs=1e-9)


def test_prefetch_one_group_ahead_hides_a_copy_shorter_than_the_group():
    r = simulate([1.0, 1.0], [2.0, 2.0], [0, 0], [100, 0], d2h_bandwidth=1e12, h2d_bandwidth=100.0,
                 prefetch_depth=1)
    assert r.backward_stall_s == pytest.approx(0.0, abs=1e-9)


def test_deeper_prefetch_trades_memory_for_stall():
    args = ([1.0] * 6, [1.0] * 6, [0] * 6, [50] * 6)
    shallow = simulate(*args, d2h_bandwidth=1e12, h2d_bandwidth=40.0, prefetch_depth=0)
    deep = simulate(*args, d2h_bandwidth=1e12, h2d_bandwidth=40.0, prefetch_depth=3)
    assert deep.stall_s < shallow.stall_s
    assert deep.peak_bytes > shallow.peak_bytes


def test_slow_d2h_stalls_forward():
    # 200 bytes at 100 B/s = 2 s of copy; the next group computes 1 s, then waits 1 s to free
    r = simulate([1.0, 1.0], [1.0, 1.0], [0, 0], [200, 0], d2h_bandwidth=100.0, h2d_bandwidth=1e12)
    assert r.forward_stall_s == pytest.approx(1.0)
    assert math.isclose(r.step_s, 4.0 + r.stall_s)


@pytest.mark.parametrize("bad", [
    dict(bwd_s=[1.0]), dict(d2h_bandwidth=0.0), dict(prefetch_depth=-1),
])
def test_invalid_inputs_raise_with_the_api_name(bad):
    kwargs = dict(fwd_s=[1.0, 1.0], bwd_s=[1.0, 1.0], resident_bytes=[0, 0], swap_bytes=[1, 1],
                  d2h_bandwidth=1.0, h2d_bandwidth=1.0, prefetch_depth=1)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=r"swap_pass\.simulate: "):
        simulate(**kwargs)
