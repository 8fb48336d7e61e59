"""``scripts/gpu_check.sh`` parses, and runs the stages the GPU check needs (dry run on CPU:
slow)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses_and_runs_the_required_stages():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "pytest -q -m accelerator" in text
    assert "tests/reliability/test_cuda_races.py" in text and "TORCH_CUDA_SANITIZER" in text
    assert 'PRESET="${GPU_CHECK_PRESET:-llama-8b-layer}"' in text
    assert '--json "$OUT/$1.json"' in text and "timeout" in text
    assert "pip install --no-deps --no-build-isolation -e ." in text
    assert "python3 -m swap_pass capacity --preset \"$PRESET\"" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text and "pinned.txt" in text
    races = (ROOT / "tests" / "reliability" / "test_cuda_races.py").read_text()
    for needed in ("slow_producer", "sync_each_step=False", "interleaved", 'mode="reduce-overhead"',
                   "host_memory_stats", '["eager", "graph", "smart"]'):
        assert needed in races, needed


@pytest.mark.slow
def test_dry_run_writes_its_outputs_under_out(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_NO_INSTALL": "1",
           "GPU_CHECK_PRESET": "tiny",
           "GPU_CHECK_BENCH_ARGS": "--layers 2 --seq 64 --steps 1 --warmup 1 --no-smart-rows",
           "GPU_CHECK_CAPACITY_CAP": "3MiB", "GPU_CHECK_CAPACITY_ARGS": "--seq 64 --search-max 12"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "bench bench-tiny: ok" in summary and "bench bench-tiny-compile: ok" in summary
    rows = {r["key"]: r for r in json.loads((tmp_path / "bench-tiny.json").read_text())["rows"]}
    assert rows["no_swap"]["status"] == "ok"
    assert (tmp_path / "env.txt").read_text().startswith("torch ")
    assert "capacity (real cap): ok" in summary
    capacity = json.loads((tmp_path / "capacity-tiny.json").read_text())
    assert capacity["virtual_cap"] is True and all(
        r["peak_bytes"] <= 3 * 2**20 for r in capacity["rows"])
