"""The stage machine alone: every transition and its log line."""

from __future__ import annotations

from swap_pass.smart.reports import Stage, StageController


def test_warmup_then_gen_policy_then_stable():
    c = StageController(warmup_steps=2, threshold=0.1)
    assert c.stage == "warmup"
    assert c.end_step(0, policy_built=False, distance=None) == Stage.WARMUP
    assert c.end_step(1, policy_built=False, distance=None) == Stage.GEN_POLICY
    assert c.end_step(2, policy_built=True, distance=None) == Stage.STABLE
    assert [(e.step, e.before.value, e.after.value) for e in c.log] == [
        (1, "warmup", "gen_policy"), (2, "gen_policy", "stable")]


def test_zero_warmup_starts_in_gen_policy():
    assert StageController(warmup_steps=0, threshold=0.1).stage == Stage.GEN_POLICY


def test_stable_stays_on_identical_signature_and_logs_nothing():
    c = StageController(warmup_steps=0, threshold=0.1)
    c.end_step(0, policy_built=True, distance=None)
    for step in range(1, 5):
        assert c.end_step(step, policy_built=False, distance=None) == Stage.STABLE
    assert len(c.log) == 1 and c.replans == 0


def test_small_change_is_absorbed_and_logged_large_change_replans():
    c = StageController(warmup_steps=0, threshold=0.1)
    c.end_step(0, policy_built=True, distance=None)
    assert c.end_step(1, policy_built=False, distance=0.05) == Stage.STABLE
    assert "absorbed" in c.log[-1].reason and c.replans == 0
    assert c.end_step(2, policy_built=False, distance=0.5) == Stage.GEN_POLICY
    assert "0.500 > 0.100" in c.log[-1].reason and c.replans == 1


def test_gen_policy_waits_until_a_policy_is_built():
    c = StageController(warmup_steps=0, threshold=0.1)
    assert c.end_step(0, policy_built=False, distance=None) == Stage.GEN_POLICY
    assert c.log == []
