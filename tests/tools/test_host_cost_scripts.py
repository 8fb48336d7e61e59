"""``scripts/host_cost.py``: every mode runs the bench's own methods and really swaps; the
instruction count says what to install without valgrind (the callgrind run itself takes
minutes: not here)."""

from __future__ import annotations

import gc
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

import swap_pass
from swap_pass.tools.bench.host_cost import HostCostModel, minimal_swap

ROOT = Path(__file__).resolve().parents[2]
EAGER = "recompute + swap (eager)"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("host_cost", ROOT / "scripts" / "host_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _threads_kept():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    assert swap_pass.swap_stats().host_bytes_in_use == 0  # nothing left on the host


def _swaps() -> tuple[int, int]:
    stats = swap_pass.swap_stats()
    return stats.swap_outs, stats.swap_ins


def test_the_bare_reference_frees_each_inner_input_and_brings_it_back_exactly():
    torch.manual_seed(0)
    plain, swapped = HostCostModel(4), HostCostModel(4)
    swapped.load_state_dict(plain.state_dict())
    x = torch.randn(1, 4, 8, requires_grad=True)
    method = minimal_swap(swapped, x)
    inputs = []
    handles = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
               for layer in swapped.layers]
    try:
        loss = swapped(x)
        # recomputed in backward, so checkpoint keeps the inputs: the inner two were freed
        assert [t.untyped_storage().nbytes() == 0 for t in inputs] == [False, True, True, False]
        loss.backward()
    finally:
        method.close()
        for h in handles:
            h.remove()
    plain(x.detach().requires_grad_()).backward()
    for a, b in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert all(t.untyped_storage().nbytes() > 0 for t in inputs)


def test_method_names_take_short_names_and_refuse_unknown_ones(tool):
    assert tool.method_names("eager,both-ways") == [EAGER, "torch save_on_cpu (copying both ways)"]
    assert tool.method_names(None) is None
    with pytest.raises(SystemExit, match=r"methods \['nope'\] are unknown"):
        tool.method_names("eager,nope")


def test_time_mode_is_the_bench_measure_of_the_methods_chosen(tool, tmp_path, capsys,
                                                            monkeypatch):
    before, at_reset = _swaps(), []
    reset = swap_pass.reset

    def reading_reset() -> None:  # the bench's measure resets at its end: read the counts first
        at_reset.append(_swaps())
        reset()

    monkeypatch.setattr(swap_pass, "reset", reading_reset)
    found = tool.run(["time", "--layers", "4", "--steps", "2", "--methods", "eager",
                      "--json", str(tmp_path / "t.json")])
    assert list(found["rows"]) == ["no swap", EAGER] and found["rounds"] == 2
    outs, ins = (a - b for a, b in zip(at_reset[-1], before, strict=True))
    # 5 warm-up steps and 2 rounds of 2 steps of the eager model, 3 inputs out and back in each
    assert outs == ins == (5 + 2 * 2) * 3
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["meta"]["command"].startswith("python scripts/host_cost.py time --layers 4")
    assert written["rows"] == found["rows"] and written["meta"]["build"]
    assert EAGER in capsys.readouterr().out


def test_stages_mode_times_every_stage_of_every_swapped_layer(tool):
    before = _swaps()
    found = tool.stages_mode(layers=4, steps=3, warmup=1)
    outs, ins = (a - b for a, b in zip(_swaps(), before, strict=True))
    # 4 steps of the group wrapper (2 of 4 layer inputs: not the first, the caller's, nor the
    # last) and of the eager model (all but the last: the input needs grad, so it may leave):
    # the groups really moved data, out and back.
    assert outs == ins == 4 * (2 + 3)
    assert set(found["stages_us"]) == {
        "bare: allocate a host buffer", "bare: copy out", "bare: free",
        "bare: re-allocate, copy back", "group: SwapTensors([x])", "group: swap_to_host()",
        "group: wait_d2h()", "group: swap_to_device()", "group: wait_h2d()"}
    assert all(us > 0 for us in found["stages_us"].values())
    assert list(found["added_us_per_layer"]) == ["bare", "group", EAGER]


def test_calls_mode_counts_what_the_eager_swap_adds(tool):
    before = _swaps()
    found = tool.calls_mode(layers=4, steps=1, names=[EAGER])
    outs, _ = (a - b for a, b in zip(_swaps(), before, strict=True))
    assert outs == (3 + 1) * 3  # 3 untraced steps and 1 traced one, 3 inputs swapped in each
    row = found["rows"][EAGER]
    assert row["bytecodes"] > 100 and row["calls"] > 5
    assert any(f["where"].startswith("swap_pass/") for f in row["top"])


def test_the_counted_steps_swap_every_eager_layer_input_but_the_last(tool):
    before = _swaps()
    tool.counted_steps(layers=4, steps=1, names=["no swap", EAGER])
    # 5 warm-up steps and 2 rounds of 1 step of the eager model, 3 layer inputs swapped in each
    assert _swaps()[0] - before[0] == 7 * 3


def test_without_valgrind_it_says_what_to_install(tool, monkeypatch):
    monkeypatch.delenv(tool._CHILD, raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match=r"valgrind, callgrind_annotate not found; install"):
        tool.instructions_mode(layers=2, steps=1)


def test_instruction_rows_read_each_swap_row_over_each_copying_row(tool):
    names = ["no swap", EAGER, "torch save_on_cpu (copying)",
             "torch save_on_cpu (copying both ways)"]
    per_step = [1000, 1060, 1010, 1020]  # one layer, 2 x 1 steps
    found = {symbol: 2 * n for (symbol, _), n in zip(tool._DRIVERS, per_step, strict=True)}
    rows = tool.instruction_rows(found, names, layers=1, steps=1)["rows"]
    assert rows[EAGER]["added"] == 60 and rows["no swap"]["per_layer"] == 1000
    assert rows[EAGER]["over"] == {"torch save_on_cpu (copying both ways)": 3.0,
                                   "torch save_on_cpu (copying)": 6.0}
    with pytest.raises(SystemExit, match="callgrind counted nothing"):
        tool.instruction_rows({}, names, layers=1, steps=1)


def test_gc_mode_times_collections_of_the_steps_it_runs_and_only_those(tool):
    before, callbacks = _swaps(), list(gc.callbacks)
    found = tool.collections_of(EAGER, layers=4, steps=30, warmup=2)
    assert _swaps()[0] - before[0] == 32 * 3  # every step swapped 3 inputs
    assert gc.callbacks == callbacks  # its timer is gone with the run
    assert len(found["counts"]) == len(found["ms"]) == 3 and found["counts"][0] > 0
    assert found["us_per_layer"] == pytest.approx(sum(found["ms"]) * 1e3 / 30 / 4)
