"""``swap-pass bench``: every row runs or says why, JSON and plot are written, numbers are real.

The rows of methods not yet in this build (eager, compile swap, SmartSwap) are checked for a
clear skip reason here; where the method is present, its own test below runs it for real.
A test-local method built on the runtime (swap every layer input but the last after forward,
restore at the start of backward) exercises the swap columns now: bytes, achieved bandwidth,
memory curve, the anchor.
"""

from __future__ import annotations

import gc
import json
import random
import re
import warnings

import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.tools.bench import (
    BenchContext,
    Method,
    MethodResult,
    Runner,
    get_preset,
    run_bench,
    run_method,
    write_json,
)
from swap_pass.tools.bench.methods import METHODS, MethodSkipped, require
from swap_pass.tools.bench.run import compare_losses
from swap_pass.tools.cli import main

CPU = torch.device("cpu")
SMALL = get_preset("tiny").resized(num_layers=4, seq=128, batch=2, warmup_steps=1, timed_steps=1)
MODEL_NEEDS = {"eager_swap": "enable_swap_layer_input", "compile_swap": "make_swap_backend",
               "smartswap": "SmartSwap"}


def _swap_inputs_after_forward(model: torch.nn.Module, ctx: BenchContext) -> Runner:
    """Swap every layer input but the last once forward is done; restore them when backward
    starts."""
    inputs: list[torch.Tensor] = []
    handles = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
               for layer in model.layers[:-1]]

    def forward(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs.clear()
        loss = model(input_ids, labels)
        groups = [SwapTensors([x]) for x in inputs]
        for g in groups:
            g.swap_to_host()
            g.wait_d2h()
        assert all(x.untyped_storage().nbytes() == 0 for x in inputs)  # really freed

        def restore(grad: torch.Tensor) -> torch.Tensor:
            for g in groups:
                g.swap_to_device()
                g.wait_h2d()
            return grad

        loss.register_hook(restore)
        return loss

    return Runner(forward=forward, close=lambda: [h.remove() for h in handles])


RUNTIME_SWAP = Method("runtime_swap", "runtime swap after forward", _swap_inputs_after_forward,
                      recompute=True, reference="recompute")


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--preset", "tiny", "--layers", "4", "--seq", "128", "--batch", "2",
            "--steps", "1", "--warmup", "1", "--device", "cpu", "--no-smart-rows", "--no-host-rows",
            "--json", str(out / "b.json"), "--plot", str(out / "m.png")]
    swap_pass.reset()
    rc = main(argv)
    swap_pass.reset()
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # beside the JSON
    return rc, json.loads((out / "b.json").read_text()), out / "m.png"


@pytest.mark.slow
def test_bench_prints_every_row_and_writes_json_and_plot(bench_json, capsys):
    rc, data, png = bench_json
    assert rc == 0
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) == {m.key for m in METHODS}
    for r in rows.values():
        assert r["status"] in ("ok", "skipped"), r
        assert r["status"] == "ok" or r["reason"], r
    for key in ("no_swap", "recompute", "compile", "save_on_cpu"):
        assert rows[key]["status"] == "ok", rows[key]
        assert rows[key]["steps"] == 3 and len(rows[key]["losses"]) == 3
    for key, name in MODEL_NEEDS.items():
        if not hasattr(swap_pass, name):
            assert rows[key]["reason"] == f"swap_pass.{name} not available in this build"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["meta"]["command"].startswith("swap-pass bench --preset tiny")
    assert data["extra"] == {"status": "skipped", "reason": "--no-smart-rows", "rows": []}
    assert data["host"] == {"status": "skipped", "reason": "--no-host-rows"}
    assert data["meta"]["threads"] == 1 and torch.get_num_threads() != 0


@pytest.mark.slow
def test_bench_numbers_are_measured_not_assumed(bench_json):
    _, data, _ = bench_json
    rows = {r["key"]: r for r in data["rows"]}
    base, rec = rows["no_swap"], rows["recompute"]
    assert base["memory_ratio"] == 1.0
    for r in (base, rec):  # paired timing: one pace-setter step after each timed step
        assert len(r["paired_ratios"]) == len(r["pace_times_s"]) == len(r["step_times_s"]) == 1
        assert (r["time_ratio"] == r["paired_ratios"][0]
                == r["step_times_s"][0] / r["pace_times_s"][0])
        assert (r["cpu_ratio"] == r["paired_cpu_ratios"][0]
                == r["cpu_times_s"][0] / r["pace_cpu_times_s"][0])
        assert r["tokens_ratio"] == pytest.approx(1 / r["time_ratio"]) and r["cpu_s"] > 0
    assert base["losses_match"] is None  # it is the reference
    # Full recompute keeps only layer inputs: its step peak is far below no swap's.
    assert 0 < rec["peak_bytes"] < 0.5 * base["peak_bytes"]
    assert rec["losses_match"] is True and rec["max_loss_diff"] == 0.0
    # On CPU save_on_cpu has nowhere to move tensors to: same peak, same losses.
    assert rows["save_on_cpu"]["losses_match"] is True
    # Within 1%: runs of the same steps have differed by a few KiB of allocator bookkeeping.
    assert rows["save_on_cpu"]["peak_bytes"] == pytest.approx(base["peak_bytes"], rel=0.01)
    assert rows["compile"]["losses_match"] is not None
    assert max(base["curve_bytes"]) == base["peak_bytes"] and base["curve_ms"][0] == 0.0


def test_runtime_swap_fills_the_swap_columns_and_the_anchor(monkeypatch):
    monkeypatch.setattr("swap_pass.tools.bench.run.METHODS", [METHODS[0], METHODS[1], RUNTIME_SWAP])
    report = run_bench(SMALL, BenchContext(CPU), smart_rows=False, host_rows=False)
    row = report.row("runtime_swap")
    swapped = (SMALL.model.num_layers - 1) * SMALL.layer_input_bytes
    assert row.status == "ok", row.reason
    assert row.losses_match is True  # against full recompute, bitwise
    assert row.swapped_out_bytes == row.swapped_in_bytes == swapped
    assert row.peak_device_bytes_released == row.peak_host_bytes == swapped
    assert row.d2h_gbs is not None and row.d2h_gbs > 0 and row.h2d_gbs > 0
    # The freed storages show in the allocator curve: it falls by the swapped bytes.
    # Consecutive pairs: the shifted copy is one shorter, so zip stops one early on purpose.
    drops = [a - b for a, b in zip(row.curve_bytes, row.curve_bytes[1:], strict=False)]
    assert sum(d for d in drops if d == SMALL.layer_input_bytes) >= swapped
    anchor = report.anchor
    assert anchor["status"] == "ok" and anchor["what"].startswith("CPU memcpy")
    assert anchor["chunk_bytes"] == SMALL.layer_input_bytes and anchor["d2h_gbs"] > 0


def test_skip_reasons_name_what_is_missing():
    with pytest.raises(MethodSkipped,
                       match=r"^swap_pass\.no_such_api not available in this build$"):
        require("swap_pass", "no_such_api")
    with pytest.raises(MethodSkipped, match=r"^no_such_peer_lib is not installed"):
        require("no_such_peer_lib.training", "OffloadActivations")


def test_torchtune_row_on_cpu_is_skipped_as_cuda_only():
    # torchtune 0.6.1's OffloadActivations calls torch.cuda.default_stream() whatever its flags.
    torchtune = next(m for m in METHODS if m.key == "torchtune")
    row = run_method(torchtune, SMALL, BenchContext(CPU))
    assert row.status == "skipped" and "CUDA-only" in row.reason and "device is cpu" in row.reason


def test_a_failing_method_is_a_row_not_a_crash():
    def broken(model, ctx):
        raise RuntimeError("boom")

    row = run_method(Method("broken", "broken", broken), SMALL, BenchContext(CPU))
    assert (row.status, row.reason) == ("failed", "RuntimeError: boom")


def test_compare_losses_sees_one_ulp():
    a = torch.tensor(1.0)
    ref = MethodResult("a", "a", "ok", loss_tensors=[a, a])
    row = MethodResult("b", "b", "ok", loss_tensors=[a, torch.nextafter(a, torch.tensor(2.0))])
    compare_losses(row, ref)
    assert row.losses_match is False and 0 < row.max_loss_diff < 1e-6


def test_json_is_strict(tmp_path):
    from swap_pass.tools.bench.run import BenchReport

    row = MethodResult("x", "x", "ok", step_s=float("nan"))
    write_json(BenchReport({"m": 1}, [row], {}, {}), str(tmp_path / "r.json"))
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and json.loads(text)["rows"][0]["step_s"] is None


@pytest.mark.parametrize("key", sorted(MODEL_NEEDS))
def test_merged_swap_rows_run_and_match(key):
    if not hasattr(swap_pass, MODEL_NEEDS[key]):
        pytest.skip(f"swap_pass.{MODEL_NEEDS[key]} not available in this build")
    methods = {m.key: m for m in METHODS}
    ctx = BenchContext(CPU)
    report = run_bench(SMALL, ctx, methods=[key, methods[key].reference or "no_swap", "recompute"],
                       smart_rows=False, host_rows=False)
    row = report.row(key)
    assert row.status == "ok", row.reason
    assert row.losses_match is True
    # Bytes really went through the runtime and its host pool (every path counts these two).
    assert row.swapped_out_bytes > 0 and row.peak_host_bytes > 0


def test_smartswap_extra_rows_or_their_skip_reason():
    from swap_pass.tools.bench.run import smart_extra_rows

    try:
        import swap_pass.tools.smart_bench  # noqa: F401
    except ImportError:
        extra = smart_extra_rows()
        assert extra["status"] == "skipped" and "not available in this build" in extra["reason"]
        return
    extra = smart_extra_rows(overhead_steps=3, dynamic_steps=4)
    assert extra["status"] == "ok"
    labels = [r["label"] for r in extra["rows"]]
    assert any(label.startswith("profiler overhead: ") for label in labels)
    assert any(label.startswith("budget: ") for label in labels)
    assert {r["section"] for r in extra["rows"]} == {"profiler overhead", "budget", "dynamic"}
    change, after = [r["data"] for r in extra["rows"] if r["label"] == "budget: smartswap"][-2:]
    assert change["seq"] == after["seq"] == 384 and change["stage"] == "stable"
    # The change step falls back (no plan is as long) within budget; the next step runs the plan
    # made from the change step's own profile.
    assert change["fell_back"] and change["within_budget"]
    assert after["stage"] == "stable" and not after["fell_back"] and after["within_budget"]
    dynamic = [r["data"] for r in extra["rows"] if r["label"].startswith("dynamic: ")]
    assert [d["steps"] for d in dynamic] == [4, 4] and dynamic[0]["profiling"] == 1


def test_host_cost_rows_measure_every_way_in():
    from swap_pass.tools.bench.host_cost import HOST_METHODS, host_us_per_layer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = host_us_per_layer(layers=4, rounds=3, warmup=1)
    # SmartSwap's process-wide hooks must not reach the other methods' rounds: packed by them,
    # the eager row's layer inputs would be shared and stay on the device.
    assert not [w for w in caught if "shares its storage" in str(w.message)]
    assert list(rows) == list(HOST_METHODS)
    assert rows["no swap"]["us_per_layer"] == 0.0  # the reference of every difference
    assert all(r["step_cpu_ms"] > 0 for r in rows.values())
    assert swap_pass.swap_stats().host_bytes_in_use == 0 and torch.get_num_threads() >= 1
    assert gc.isenabled()  # paused only inside the timed steps


def test_host_rounds_pair_each_step_with_a_no_swap_step_each_after_its_own():
    from swap_pass.tools.bench.host_cost import _Method, _rounds

    calls, collecting = [], []

    def step(name):
        def run():
            calls.append(name)
            collecting.append(gc.isenabled())
        return run

    built = {name: _Method(step(name)) for name in ("no swap", "a", "b", "c")}
    diffs, steps = _rounds(built, rounds=4, warmup=1, rng=random.Random(0))
    rounds_calls = calls[4:]  # after one warm-up step of each
    quads = [rounds_calls[i:i + 4] for i in range(0, len(rounds_calls), 4)]
    assert all(q[0] == q[1] == "no swap" and q[2] == q[3] != "no swap" for q in quads)
    pairs = [(q[1], q[3]) for q in quads]
    rounds = [sorted(name for _, name in pairs[i:i + 3]) for i in range(0, 12, 3)]
    assert rounds == [["a", "b", "c"]] * 4  # every method once per round
    assert len({tuple(name for _, name in pairs[i:i + 3]) for i in range(0, 12, 3)}) > 1  # shuffled
    assert not any(collecting)  # the collector is paused in every timed step
    assert [len(diffs[n]) for n in ("a", "b", "c")] == [4, 4, 4] and len(steps["no swap"]) == 12


def test_save_on_cpu_both_ways_copies_out_and_back_and_matches_no_hooks():
    from swap_pass.tools.bench.host_cost import SaveOnCpuBothWays

    x = torch.randn(4, 8, requires_grad=True)
    x_before = x.detach().clone()
    unpacked = []  # (the host tensor, what the unpack hook returned)
    hooks = SaveOnCpuBothWays()
    unpack = hooks.unpack_hook

    def recording_unpack(packed):
        unpacked.append((packed[1], unpack(packed)))
        return unpacked[-1][1]

    hooks.unpack_hook = recording_unpack
    with hooks:
        y = torch.tanh(x)  # tanh saves its result: packed to the host, unpacked in backward
    y.sum().backward()
    x_ref = x_before.clone().requires_grad_()
    torch.tanh(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(x.detach(), x_before)
    assert unpacked, "the unpack hook never ran"
    for packed, restored in unpacked:  # a copy back, as on an accelerator: not the host tensor
        assert restored.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
        assert torch.equal(restored, packed)
    assert packed.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()  # a copy out


def _columns(lines: list[str]) -> dict[str, list[str]]:
    """A printed table's rows by their first cell, split on runs of two or more spaces."""
    import re

    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in lines)}


def test_host_table_reads_swap_rows_over_each_copying_row():
    from swap_pass.tools.bench.report import _host_lines

    def row(us):
        return {"us_per_layer": us, "iqr_us_per_layer": 1.0, "step_cpu_ms": 2.0}

    rows = {"no swap": {**row(0.0), "step_cpu_ms": 1.0}, "torch save_on_cpu (copying)": row(10.0),
            "torch save_on_cpu (copying both ways)": row(20.0),
            "recompute + swap (eager)": row(60.0), "SmartSwap": row(70.0)}
    lines = _host_lines({"status": "ok", "layers": 16, "rounds": 60, "rows": rows})
    assert lines[1].startswith("host cost per layer (16 tiny checkpointed layers")
    assert set(lines[3]) == {"-", " "}  # the rule under the head, as in the upper table
    table = _columns(lines[2:3] + lines[4:])
    assert table["method"] == ["host us/layer", "IQR us", "cpu", "/ both ways", "/ copying"]
    assert table["recompute + swap (eager)"] == ["60.0", "1.0", "2.00x", "3.00x", "6.00x"]
    assert table["SmartSwap"] == ["70.0", "1.0", "2.00x", "3.50x", "7.00x"]
    assert table["torch save_on_cpu (copying)"] == ["10.0", "1.0", "2.00x", "-", "-"]
    assert "no swap" not in table  # the reference: 0 by definition


def test_smartswap_rows_print_as_one_short_table_per_section():
    from swap_pass.tools.bench.report import _extra_lines
    from swap_pass.tools.bench.run import _extra_row

    overhead = [{"name": name, "clock": "cpu", "step_ms": ms, "ratio_vs_none": vs_none,
                 "ratio_vs_torch_profiler": vs_torch}
                for name, ms, vs_none, vs_torch in [
                    ("none", 100.0, 1.0, 0.96),
                    ("smart.lightweight_profiler", 102.0, 1.02, 0.98),
                    ("torch.profiler(record_shapes)", 104.0, 1.04, 1.0)]]
    budget = [{"name": "no swap", "peak_bytes": 4 << 20},
              {"name": "smartswap", "step": 0, "seq": 256, "stage": "warmup", "fell_back": False,
               "peak_bytes": 1 << 20, "budget_bytes": 1 << 20, "within_budget": True,
               "swapped_bytes": 3 << 20, "step_ms": 50.0}]
    dynamic = [{"name": f"varying length, plan_cache_size={size}", "steps": 3,
                "lengths": [128, 256],
                "planned": planned, "conservative": 1, "profiling": 1, "over_budget": 0,
                "max_peak_over_budget": 0.999, "step_ms": 20.0, "plain_step_ms": 16.0,
                "ratio_vs_none": 1.25, "cache": cache, "kinds": kinds}
               for size, planned, cache, kinds in [
                   (8, 1, {"plans": 2, "hits": 1, "misses": 2, "evictions": 0, "derived": 0},
                    "cPp"),
                   (0, 1, None, "cPp")]]
    rows = ([_extra_row("profiler overhead", r) for r in overhead]
            + [_extra_row("budget", r) for r in budget]
            + [_extra_row("dynamic", r) for r in dynamic])
    lines = _extra_lines({"status": "ok", "reason": "", "rows": rows})
    titles = [i for i, line in enumerate(lines) if line.startswith("SmartSwap")]
    assert [lines[i].split(" (")[0] for i in titles] == [
        "SmartSwap profiler overhead", "SmartSwap budget steps", "SmartSwap, varying lengths"]
    assert "without swap: 4.00 MiB" in lines[titles[1]]
    tables = [_columns(lines[i + 1:i + 2] + lines[i + 3:j - 1])
              for i, j in zip(titles, [*titles[1:], len(lines) + 1], strict=True)]
    assert tables[0]["smart.lightweight_profiler"] == ["102.0", "1.020x", "0.980x"]
    assert tables[1]["0"] == ["256", "warmup", "no", "1.00", "1.00", "yes", "3.00", "50.0"]
    assert tables[2]["8"] == ["1", "1", "1", "0", "0.999", "20.0", "16.0", "1.25x", "1/2/0/0",
                              "cPp"]
    assert tables[2]["0"][-2:] == ["-", "cPp"]
    assert all(r["data"] in overhead + budget + dynamic for r in rows)  # all of it in --json
    assert _extra_lines({"status": "skipped", "reason": "--no-smart-rows"})[-1] == (
        "SmartSwap rows: SKIPPED: --no-smart-rows")


def test_profiler_chatter_is_dropped_and_other_output_kept(capfd):
    from swap_pass.tools.bench.measure import profile_step

    def step():
        print("from the step")
        torch.randn(64).sum()

    profile_step(CPU, step)
    out, err = capfd.readouterr()
    assert "from the step" in out
    assert "profiler_start" not in out + err and "profiler_stop" not in out + err


def test_profiler_chatter_after_a_progress_bar_is_dropped():
    from swap_pass.tools.bench.measure import _PROFILER_CHATTER

    text = ("step:  33%|###| 3/9\rUSDT:2026-12-01 05:31:08 1:1 SyncActivityProfilerHandler.cpp:59] "
            "profiler_stop\nUSDT: not the profiler's\nkept\n")
    assert _PROFILER_CHATTER.sub("", text) == (
        "step:  33%|###| 3/9\rUSDT: not the profiler's\nkept\n")


def test_load_caveat_names_load_or_spread():
    from swap_pass.tools.bench.run import load_caveat

    quiet = MethodResult("a", "a", "ok", paired_ratios=[1.0, 1.01, 0.99, 1.0])
    noisy = MethodResult("b", "b", "ok", paired_ratios=[1.0, 2.0, 0.5, 1.5])
    assert load_caveat({"load_avg_1m": [0.1, 0.2]}, [quiet]) == ""
    busy = load_caveat({"load_avg_1m": [0.1, 64.0]}, [quiet])
    assert busy.startswith("caveat: step times are rough here (load average up to 64.0 on")
    # inclusive quartiles of 0.5, 1, 1.5, 2: (1.625 - 0.875) / 1.25
    assert "spread of paired step times up to 60%" in load_caveat({"load_avg_1m": [0.1]}, [noisy])


def test_plot_x_is_the_step_fraction_and_small_rows_get_a_zoom(tmp_path):
    from swap_pass.tools.bench.report import _curves, _zoom_limit, plot_memory
    from swap_pass.tools.bench.run import BenchReport

    def row(label, peak_mib, ms):
        return MethodResult(label, label, "ok", curve_ms=[0.0, 1.0, ms],
                            curve_bytes=[0, peak_mib << 20, 0])

    rows = [row("no swap", 200, 300.0), row("smart", 53, 500.0), row("recompute", 23, 600.0),
            row("swap", 16, 900.0)]
    report = BenchReport({"preset": {"name": "t"}, "device": "cpu"}, rows, {}, {})
    curves = _curves(report)
    assert [c[1][-1] for c in curves] == [1.0] * 4 and max(curves[3][2]) == 16.0
    assert _zoom_limit(curves) == pytest.approx(23 * 1.15)  # 16 and 23 side by side
    assert _zoom_limit(curves[:1]) is None
    plot_memory(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_is_plain_text_and_names_defaults(capsys):
    for command in ("demo", "bench", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and "the preset's)" not in text.replace("the preset's;", "")
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 64)" in text and "(default: 16)" in text and "(default: 4)" in text


def test_hf_offload_row_on_cpu_is_skipped_for_its_pinned_memory():
    hf = next(m for m in METHODS if m.key == "hf_offload")
    row = run_method(hf, SMALL, BenchContext(CPU))
    assert row.status == "skipped", row
    assert "save_on_cpu(pin_memory=True)" in row.reason and "device cpu" in row.reason


def test_the_hf_model_is_the_bench_model_and_trains_its_own_parameters():
    """HF Llama built from the bench model (checkpointing without offload, which runs on CPU)
    gives recompute's losses at every step: same weights, and the optimizer steps the HF model."""
    pytest.importorskip("transformers")
    from swap_pass.tools.bench.hf_offload import hf_llama_like, logits_loss

    def hf_checkpointed(model, ctx):
        hf = hf_llama_like(model)
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
        return Runner(forward=logits_loss(hf), module=hf)

    preset = SMALL.resized(timed_steps=2, warmup_steps=1)
    ref = run_method(next(m for m in METHODS if m.key == "recompute"), preset, BenchContext(CPU))
    row = run_method(Method("hf", "hf", hf_checkpointed, recompute=True), preset,
                     BenchContext(CPU), on_error=lambda err: (_ for _ in ()).throw(err))
    assert row.status == "ok" and len(row.losses) == 4, row
    assert row.losses == ref.losses  # the later steps too: the HF parameters were stepped


def test_bench_says_where_it_can_write_and_each_phase_it_starts(capsys, monkeypatch):
    import swap_pass.tools.bench.run as bench_run

    argv = ["bench", "--preset", "tiny", "--layers", "2", "--seq", "32", "--batch", "1",
            "--steps", "1", "--warmup", "1", "--device", "cpu", "--methods", "no_swap",
            "--no-smart-rows"]
    # The host-cost phase itself is measured elsewhere (tests/tools/test_host_cost_scripts.py);
    # here only that the command announces it before it starts.
    monkeypatch.setattr(bench_run, "host_cost_rows",
                        lambda: {"status": "skipped", "reason": "not measured here"})
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "... no swap" in captured.err
    assert "... host CPU time per layer" in captured.err
    assert "--json PATH writes this report as JSON" in captured.out


def test_bench_prints_the_rates_budget_mode_planned_with(capsys, monkeypatch):
    """Budget mode measures its copy and FLOP rates on the device (once per process); the bench
    says which it planned with, beside the rows."""
    import swap_pass.tools.bench.run as bench_run
    from swap_pass.cost import probes as cost_probes

    monkeypatch.setattr(bench_run, "host_cost_rows",
                        lambda: {"status": "skipped", "reason": "not measured here"})
    cost_probes.clear_measured_rates()
    argv = ["bench", "--preset", "tiny", "--layers", "2", "--seq", "32", "--batch", "1",
            "--steps", "1", "--warmup", "1", "--device", "cpu", "--methods", "compile_budget",
            "--no-smart-rows", "--compile-inner", "aot_eager"]
    try:
        with warnings.catch_warnings():  # whether the tiny model reaches 0.5 depends on the rates
            warnings.filterwarnings("ignore", message=r".*memory_budget=0\.5 not reached")
            assert main(argv) == 0
    finally:
        rates = cost_probes.measured_rates()
        cost_probes.clear_measured_rates()
    out = capsys.readouterr().out
    assert {what for what, *_ in rates} == {"copy", "flops"}
    assert re.search(r"budget mode planned with: device-to-host copy [0-9.]+ GB/s \(cpu, \d+ CPU "
                     r"threads\)", out), out
    assert re.search(r"budget mode planned with: float32 matmul [0-9.]+ TFLOP/s \(cpu, ", out), out


def test_offloading_tools_rows_against_hf_checkpointing():
    """The tools' rows train HF Llama beside HF checkpointing: the flags swap_pass serves and
    accelerate's own offload are exact against it, the served ones freed layer inputs (all but
    the last: 3 of SMALL's 4 layers), and a tool that cannot run here says why in its row."""
    pytest.importorskip("transformers")
    from swap_pass.tools.bench.report import format_report, tools_section

    keys = ["trl_offload", "trl_swap", "torchtune_offload", "torchtune_swap",
            "accelerate_offload", "accelerate_swap"]
    report = run_bench(SMALL, BenchContext(CPU), methods=keys, smart_rows=False,
                       host_rows=False)
    assert report.row("hf_recompute").status == "ok"  # brought along as their reference
    layer_input = SMALL.layer_input_bytes
    for key in ("trl_swap", "torchtune_swap", "accelerate_swap"):
        row = report.row(key)
        assert row.status == "ok" and row.losses_match is True, (key, row.reason)
        swapped = (SMALL.model.num_layers - 1) * layer_input  # one step's, as measured
        assert row.swapped_out_bytes == row.peak_device_bytes_released == swapped, key
    accelerate = report.row("accelerate_offload")
    assert accelerate.status == "ok" and accelerate.losses_match is True
    assert accelerate.swapped_out_bytes == 0
    assert report.row("torchtune_offload").status == "skipped"
    assert "CUDA-only" in report.row("torchtune_offload").reason
    trl = report.row("trl_offload")
    assert trl.status == "skipped" and ("trl is not installed" in trl.reason
                                        or "cannot be built on cpu" in trl.reason), trl.reason
    section = tools_section(report.rows)
    assert [cells[0] for cells in section.body] == [
        "HF checkpointing", "TRL flag served by swap_pass", "torchtune flag served by swap_pass",
        "accelerate AC offload", "accelerate AC offload served by swap_pass"]
    assert section.body[0][2] == "1.00x" and section.body[0][-1] == "not compared"
    assert "fine-tuning tools' offloading against HF checkpointing" in format_report(report)
