"""The soak run in CI: a 50-step run of ``scripts/soak.py`` (the full run is 2,000 steps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import swap_pass

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
SMALL = ["--steps", "50", "--rss-from", "10", "--batch", "2", "--seq", "32", "--log-every", "0"]


@pytest.fixture(scope="module")
def soak():
    """``scripts/soak.py`` imported as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("swap_pass_soak", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("recompute", [[], ["--recompute"]], ids=["plain", "recompute"])
def test_fifty_steps_exact_clean_and_flat_rss(soak, recompute, capsys):
    assert soak.main(SMALL + recompute) == 0
    out = capsys.readouterr().out
    assert "soak: OK: 50 steps" in out and "bitwise equal to no swap at every step" in out
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == 50 * 3  # every step swapped 3 of 4 layer inputs
    assert stats.host_allocations == 3  # pooled buffers reused from step 2 on
    assert stats.host_bytes_in_use == 0 and not swap_pass.SwapLayerInputManager.manager_map


def test_negative_control_fires_the_bitwise_check(soak, capsys):
    """A twin one weight apart must fail at step 0: the comparison is not vacuous."""
    assert soak.main(SMALL + ["--negative-control"]) == 1
    assert "soak: FAILED: step 0: loss" in capsys.readouterr().out


def test_rss_growth_check_fires_past_the_limit(soak):
    assert soak.check_rss(1000, 1049, 0.05) == pytest.approx(0.049)
    with pytest.raises(soak.SoakViolation, match=r"RSS grew 5\.00% \(1000 -> 1050 bytes\)"):
        soak.check_rss(1000, 1050, 0.05)
    assert soak.rss_bytes() > 0  # /proc/self/status is read on Linux


def test_leftover_host_bytes_are_a_violation(soak):
    """A group left on the host after a step (here, made by hand) fails the clean check."""
    group = swap_pass.SwapTensors([torch.randn(16)])
    group.swap_to_host()
    with pytest.raises(soak.SoakViolation, match=r"step 7: 64 host bytes in use"):
        soak.check_clean(7)
    group.restore()
    soak.check_clean(7)
