"""``scripts/host_cost_instructions.py``: a clear exit without valgrind, and the part it counts
runs every method (the callgrind run itself takes minutes: not here)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

import swap_pass

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "host_cost_instructions", ROOT / "scripts" / "host_cost_instructions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_valgrind_it_says_what_to_install(monkeypatch):
    script = _load()
    monkeypatch.delenv(script._CHILD, raising=False)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    monkeypatch.setattr("sys.argv", ["host_cost_instructions.py"])
    with pytest.raises(SystemExit, match=r"valgrind, callgrind_annotate not found; install valgrind"):
        script.main()


def test_the_counted_steps_swap_every_eager_layer_input_but_the_last():
    script = _load()
    before, threads = swap_pass.swap_stats().swap_outs, torch.get_num_threads()
    try:
        script._steps(layers=4, steps=1)
    finally:
        torch.set_num_threads(threads)
    # 5 warm-up steps and 2 rounds of 1 step of the eager model, 3 layer inputs swapped in each
    assert swap_pass.swap_stats().swap_outs - before == 7 * 3
    assert swap_pass.swap_stats().host_bytes_in_use == 0
