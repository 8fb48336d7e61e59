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


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load():
    return _load_script("host_cost_instructions")


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


def test_the_simulated_report_prints_each_event_per_layer_and_its_ratio(capsys):
    script = _load()
    events = list(script._SIMULATED)
    plain = [1000 * (i + 1) for i in range(len(events))]
    found = {"starmap_next": plain,
             "filterfalse_next": [n + 40 * (i + 1) for i, n in enumerate(plain)],
             "dropwhile_next": [n + 10 * (i + 1) for i, n in enumerate(plain)],
             "takewhile_next": [n + 20 * (i + 1) for i, n in enumerate(plain)]}
    script._report(found, events, layers=2, steps=1, caches="--I1=32768,8,64")
    lines = capsys.readouterr().out.splitlines()
    assert "--I1=32768,8,64" in lines[1]
    assert len(lines) == 2 + len(events)
    for i, line in enumerate(lines[2:]):  # per layer: eager over both ways, then over copying
        assert script._SIMULATED[events[i]] in line and line.endswith("2.00x  4.00x"), line


def test_the_instruction_report_gives_eager_over_each_copying_row(capsys):
    script = _load()
    found = {"starmap_next": [1000], "filterfalse_next": [1060], "dropwhile_next": [1010],
             "takewhile_next": [1020]}
    script._report(found, ["Ir"], layers=1, steps=1, caches="")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["  eager / save_on_cpu (copying both ways): 3.00x",
                          "  eager / save_on_cpu (copying): 6.00x"]


def _load_gc_script():
    return _load_script("host_cost_gc")


def test_the_gc_script_times_collections_of_the_steps_it_runs_and_only_those():
    import gc

    script = _load_gc_script()
    before, callbacks = swap_pass.swap_stats().swap_outs, list(gc.callbacks)
    threads = torch.get_num_threads()
    try:
        found = script._measure("eager", layers=4, steps=30, warmup=2)
    finally:
        torch.set_num_threads(threads)
    assert swap_pass.swap_stats().swap_outs - before == 32 * 3  # every step swapped 3 inputs
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    assert gc.callbacks == callbacks  # its timer is gone with the run
    assert len(found["counts"]) == len(found["ms"]) == 3 and found["counts"][0] > 0
    assert found["us_per_layer"] == pytest.approx(sum(found["ms"]) * 1e3 / 30 / 4)


def test_the_stage_script_times_every_stage_of_every_swapped_layer():
    script = _load_script("host_cost_stages")
    before, threads = swap_pass.swap_stats(), torch.get_num_threads()
    try:
        medians, added = script.measure(layers=4, steps=3, warmup=1)
    finally:
        torch.set_num_threads(threads)
    after = swap_pass.swap_stats()
    # 4 steps of the group wrapper (2 of 4 layer inputs: not the first, the caller's, nor the
    # last) and of the eager model (all but the last: the input needs grad, so it may leave):
    # the groups really moved data, out and back.
    assert after.swap_outs - before.swap_outs == after.swap_ins - before.swap_ins == 4 * (2 + 3)
    assert after.host_bytes_in_use == 0
    assert set(medians) == {f"{way}: {stage}" for way, stage in [
        ("bare", "allocate"), ("bare", "copy out"), ("bare", "free"),
        ("bare", "re-allocate, copy back"), ("bare", "register the hook"),
        ("group", "SwapTensors()"), ("group", "swap_to_host"), ("group", "wait_d2h"),
        ("group", "swap_to_device"), ("group", "wait_h2d"), ("group", "register the hook")]}
    assert all(us > 0 for us in medians.values())
    assert list(added) == ["bare", "group", "eager"]
