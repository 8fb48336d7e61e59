"""SmartSwap's executor runs by the one stage enum: each step's report names the Stage it ran
in."""

from __future__ import annotations

from swap_pass import SmartSwap
from swap_pass.smart import Stage
from tests.smart.helpers import Pair


def _stages_of_three_steps() -> list:
    pair = Pair()
    reports = []
    with SmartSwap(pair.model, memory_budget=0.5) as smart:
        for _ in range(3):
            pair.step(smart)  # exact against the model without SmartSwap
            reports.append(smart.last_report)
    return reports


def test_each_step_report_names_the_stage_it_ran_in():
    reports = _stages_of_three_steps()
    assert [r.stage for r in reports] == [Stage.WARMUP, Stage.GEN_POLICY, Stage.STABLE]
    assert all(type(r.stage) is Stage for r in reports)
    assert reports[0].profile is None and reports[1].profile is not None  # gen_policy recorded
    assert reports[2].matched > 0 and reports[0].matched == 0  # only stable followed a plan
    assert "stage='stable'" in repr(reports[2])

