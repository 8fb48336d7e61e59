"""SmartSwap's executor runs by the one stage enum: each step's report names the Stage it ran in;
the former executor-mode names still resolve, to the stages, with a DeprecationWarning."""

from __future__ import annotations

import pytest

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


def test_the_former_exec_mode_names_are_deprecated_aliases_of_the_stages():
    with pytest.warns(DeprecationWarning, match="ExecMode is deprecated"):
        from swap_pass.smart.executor import ExecMode
    assert (ExecMode.CONSERVATIVE, ExecMode.DETAILED, ExecMode.PLANNED) == (
        Stage.WARMUP, Stage.GEN_POLICY, Stage.STABLE)
    with pytest.warns(DeprecationWarning, match="ExecMode is deprecated"):
        from swap_pass.smart.reports import ExecMode as from_reports
    assert from_reports is ExecMode
    report = _stages_of_three_steps()[-1]
    with pytest.warns(DeprecationWarning, match="StepReport.stage"):
        assert report.mode is report.stage is ExecMode.PLANNED
