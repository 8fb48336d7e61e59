"""``scripts/gpu_check.sh``: its stage limits fit 8 minutes, the headline table comes first, the
pytest stages select the tests they name, and its CPU dry run passes and feeds
``scripts/results_page.py`` (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
RACES = "tests/reliability/test_cuda_races.py"
MAX_TOTAL_S, MAX_HEADLINE_S = 480, 150
ORDER = ["headline", "tools", "setup", "races", "sanitizer", "expandable", "accelerator",
         "capacity"]


def _limits() -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_LIMITS"}  # the script's own
    out = subprocess.run(["bash", str(SCRIPT), "--limits"], capture_output=True, text=True,
                         check=True, env=env).stdout.split("\n")
    pairs = [line.split() for line in out if line.strip()]
    limits = {name: int(value) for name, value in pairs[:-1]}
    assert pairs[-1] == ["total", str(sum(limits.values()))], pairs
    return limits


def test_stage_limits_add_up_to_at_most_8_minutes_headline_first_capacity_last():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    limits = _limits()
    assert list(limits) == ORDER
    assert sum(limits.values()) <= MAX_TOTAL_S, limits
    assert limits["headline"] <= MAX_HEADLINE_S
    # the header states each stage's limit as the script runs it
    header = SCRIPT.read_text().split("\nset -uo pipefail")[0]
    stated = dict(re.findall(r"^#   (\w+) +(\d+) s  ", header, re.MULTILINE))
    assert {k: int(v) for k, v in stated.items()} == limits
    assert f"add up to {MAX_TOTAL_S} s" in header


def _k_expressions() -> dict[str, str]:
    """The ``-k`` expression each pytest stage passes for the race file."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        match = re.match(r"\s*pytest_stage (\w+) .*\"\$RACES\" -k (\"[^\"]+\"|\S+)", line)
        if match:
            out[match.group(1)] = shlex.split(match.group(2))[0]
    return out


def _collected(k: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", RACES, "-k", k], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # four pytest collections: about 35 s on 2 busy cores
def test_the_race_stages_select_what_they_promise():
    """races: every race but the sanitizer one, the compiled cases among them; sanitizer: one
    eager step, which must swap and compiles nothing; expandable: three eager races."""
    ks = _k_expressions()
    assert set(ks) == {"races", "sanitizer", "expandable"}, ks
    races = _collected(ks["races"])
    assert "test_compiled_exact_with_slow_side_streams" in races
    assert "test_reduce_overhead_compiled_layers_are_refused_with_swap_and_run_without" in races
    assert "test_retained_graph_compiled_with_slow_side_streams" in races
    assert not any("sanitizer" in name for name in races)
    assert _collected(ks["sanitizer"]) == ["test_one_eager_step_under_the_cuda_sanitizer"]
    spec = importlib.util.spec_from_file_location("cuda_races", ROOT / RACES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    child = module._SANITIZED_STEP
    assert "torch.compile" not in child and "enable_swap_layer_input" in child
    assert "swap_outs" in child
    expandable = _collected(ks["expandable"])
    assert len(expandable) == 3 and all(name.startswith("test_eager_exact") for name in expandable)


def _stages(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cpu_dry_run_passes_writes_the_headline_first_and_feeds_the_results_page(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_BENCH_ARGS": "--layers 2 --seq 64"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=MAX_TOTAL_S + 60)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = _stages(out)
    assert [s["stage"] for s in stages] == ORDER
    assert all(s["status"] == "passed" for s in stages), stages
    assert sum(s["limit_s"] for s in stages) <= MAX_TOTAL_S
    # the headline JSON exists before any later stage wrote a file
    headline = out / "headline.json"
    assert "headline.json" in stages[0]["files"]
    later = [out / f for s in stages[1:] for f in s["files"]]
    assert later and all(headline.stat().st_mtime <= f.stat().st_mtime for f in later)
    rows = {r["key"]: r for r in json.loads(headline.read_text())["rows"]}
    assert list(rows) == ["no_swap", "recompute", "eager_swap", "save_on_cpu", "hf_offload"]
    assert all(rows[k]["status"] == "ok" for k in ("no_swap", "recompute", "eager_swap",
                                                   "save_on_cpu")), rows
    assert rows["recompute"]["time_vs_recompute"] == 1.0
    assert rows["hf_offload"]["status"] == "skipped" and "pin_memory" in rows["hf_offload"][
        "reason"]
    capacity = json.loads((out / "capacity.json").read_text())
    assert capacity["virtual_cap"] is True
    assert all(r["peak_bytes"] <= 3 * 2**20 for r in capacity["rows"])
    _check_results_page(out, tmp_path / "results.md")


def _check_results_page(out: Path, page: Path) -> None:
    """The GPU tables of docs/results.md, made again from the dry run's files."""
    page.write_text((ROOT / "docs" / "results.md").read_text())
    subprocess.run([sys.executable, str(ROOT / "scripts" / "results_page.py"), "--page", str(page),
                    "--gpu-check", str(out)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = page.read_text()
    gpu = text[text.index("<!-- results_page: gpu-stages -->"):]
    assert "| headline | 135 |" in gpu and "| capacity |" in gpu
    assert re.search(r"\| full recompute \| [\d.]+ \| [\d.]+x \| [\d.]+ \| 1\.00x \|", gpu), gpu
    assert "- HF checkpointing + offload: skipped: " in gpu
    assert "virtual cap (CPU)" in gpu


@pytest.mark.slow
def test_a_stage_past_its_limit_is_killed_and_the_next_ones_still_run(tmp_path):
    """The headline stage gets 1 s (6 s less the kill grace); the bench takes longer on any
    machine (its imports alone do), so it is killed: no JSON, status "time limit", and every
    later stage still runs and records itself."""
    out = tmp_path / "out"
    limits = "headline=6 tools=6 races=6 sanitizer=6 expandable=6 accelerator=6 capacity=6"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_LIMITS": limits}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=MAX_TOTAL_S)
    stages = _stages(out)
    assert [s["stage"] for s in stages] == ORDER
    assert stages[0]["status"] == "time limit" and stages[0]["exit"] in (124, 137), stages[0]
    assert not (out / "headline.json").exists()
    assert stages[2]["stage"] == "setup" and stages[2]["status"] == "passed"
    assert (out / "env.txt").is_file()
    not_passed = sum(s["status"] != "passed" for s in stages)
    assert proc.returncode == not_passed, proc.stdout[-3000:]
    assert f"gpu_check: {not_passed} stage(s) did not pass" in (out / "summary.txt").read_text()


def test_a_limit_within_the_kill_grace_is_refused(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_LIMITS": "races=3"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 99 and "the races stage's limit is '3'" in proc.stderr
    assert not any(tmp_path.iterdir())  # refused before any stage ran
