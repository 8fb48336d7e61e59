"""``scripts/results_page.py``: the page's tables are the cells the commands print, beside the
command; text outside the markers stays; a page without a section's markers is refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from swap_pass.tools.bench.harness import MethodResult

ROOT = Path(__file__).resolve().parents[2]
EAGER = "recompute + swap (eager)"


@pytest.fixture(scope="module")
def page_tool():
    path = ROOT / "scripts" / "results_page.py"
    spec = importlib.util.spec_from_file_location("results_page", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_json() -> dict:
    rows = [MethodResult("no_swap", "no swap", "ok", step_s=0.2, cpu_s=0.19, tokens_per_s=5000.0,
                         peak_bytes=20 << 20, memory_ratio=1.0, time_ratio=1.0, cpu_ratio=1.0),
            MethodResult("eager_swap", EAGER, "ok", step_s=0.3, cpu_s=0.29, tokens_per_s=3333.0,
                         peak_bytes=4 << 20, memory_ratio=0.2, time_ratio=1.5, cpu_ratio=1.4,
                         losses_match=True, max_loss_diff=0.0, peak_host_bytes=1 << 20,
                         d2h_gbs=1.5, h2d_gbs=2.0),
            MethodResult("torchtune", "torchtune OffloadActivations", "skipped",
                         reason="torchtune OffloadActivations is CUDA-only")]

    def host(us):
        return {"us_per_layer": us, "iqr_us_per_layer": 2.0, "step_cpu_ms": 1.0}

    meta = {"command": "swap-pass bench --preset tiny --json t.json",
            "date": "2026-12-02 18:00 UTC", "machine": "2 CPU cores, x86_64",
            "torch": "2.13.0+cpu", "build": "abc1234",
            "load_avg_1m": [0.5, 0.75], "compile_inner": "aot_eager", "threads": 1,
            "preset": {"model": {"num_layers": 6, "hidden_size": 32}, "batch": 4, "seq": 256,
                       "dtype": "fp32", "timed_steps": 3}}
    overhead = {"name": "smart.lightweight_profiler", "clock": "cpu", "step_ms": 102.0,
                "ratio_vs_none": 1.02, "ratio_vs_torch_profiler": 0.98}
    return {"meta": meta, "rows": [r.to_json() for r in rows],
            "anchor": {"status": "ok", "what": "CPU memcpy (no device memory)", "chunks": 5,
                       "chunk_bytes": 131072, "d2h_gbs": 10.0, "h2d_gbs": 11.0},
            "host": {"status": "ok", "layers": 16, "rounds": 60,
                     "rows": {"no swap": host(0.0), "torch save_on_cpu (copying)": host(10.0),
                              "torch save_on_cpu (copying both ways)": host(20.0),
                              EAGER: host(60.0)}},
            "extra": {"status": "ok", "rows": [
                {"section": "profiler overhead", "label": "x", "data": overhead}]}}


PAGE = """# Measured results

Words above, kept.

## Memory and time per method

<!-- results_page: bench-methods -->
stale figures
<!-- /results_page: bench-methods -->

Words between, kept.

<!-- results_page: bench-host -->
<!-- /results_page: bench-host -->

<!-- results_page: smartswap -->
old
<!-- /results_page: smartswap -->

## Capacity

Words below, kept.
"""


def test_the_tables_are_the_printed_cells_beside_the_command(page_tool):
    page = page_tool.regenerate(PAGE, {"bench": _bench_json()})
    assert "stale figures" not in page and "\nold\n" not in page
    for kept in ("Words above, kept.", "Words between, kept.", "## Capacity", "Words below, kept."):
        assert kept in page
    lines = page.splitlines()
    command = ("Command: `swap-pass bench --preset tiny --json t.json`. Measured 2026-12-02 "
               "18:00 UTC, 2 CPU cores, x86_64, torch 2.13.0+cpu, build `abc1234`, load "
               "average 0.5-0.75.")
    assert lines.count(command) == 3  # each section says where its figures come from
    eager = next(line for line in lines if line.startswith(f"| {EAGER} | 4.00 |"))
    assert eager == (f"| {EAGER} | 4.00 | 0.20x | 300.0 | 290.0 | 1.50x | 1.40x | 3,333 | exact "
                     "| 1.50 | 2.00 | 1.00 |")
    assert "- torchtune OffloadActivations: skipped: torchtune OffloadActivations is CUDA-only" \
        in lines
    assert f"| {EAGER} | 60.0 | 2.0 | 1.00x | 3.00x | 6.00x |" in lines  # the host table
    assert "| smart.lightweight_profiler | 102.0 | 1.020x | 0.980x |" in lines
    assert page_tool.regenerate(page, {"bench": _bench_json()}) == page  # made again: the same


def test_main_writes_the_page_from_the_json_files(page_tool, tmp_path):
    (tmp_path / "b.json").write_text(json.dumps(_bench_json()))
    (tmp_path / "stages.json").write_text(json.dumps({
        "meta": _bench_json()["meta"], "steps": 200, "layers": 32,
        "stages_us": {"bare: copy out": 3.5, "group: swap_to_host()": 7.7},
        "added_us_per_layer": {"bare": 25.0, "group": 45.0, EAGER: 55.0}}))
    page = tmp_path / "results.md"
    markers = "<!-- results_page: host-stages -->\n<!-- /results_page: host-stages -->\n"
    page.write_text(PAGE + markers)
    page_tool.main(["--page", str(page), "--bench", str(tmp_path / "b.json"),
                    "--stages", str(tmp_path / "stages.json")])
    text = page.read_text()
    assert "| group: swap_to_host() | 7.70 |" in text and f"| {EAGER} | 55.0 | 2.20x |" in text
    assert "| no swap | 20.00 | 1.00x |" in text


def test_a_page_without_the_markers_is_refused(page_tool):
    with pytest.raises(SystemExit, match="the page has no section 'graph-peaks'"):
        page_tool.regenerate("# nothing here\n", {"graph": {"rows": [], "meta": {}}})


def test_the_megatron_rows_of_a_gpu_run(page_tool):
    row = {"method": "swap_pass", "status": "ok", "peak_bytes": 3 << 20, "memory_ratio": 0.5,
           "step_s": 0.25, "time_ratio": 1.1, "swapped_out_bytes": 1 << 20, "exact": True,
           "exact_vs": "recompute"}
    data = {**_bench_json(), "extra": {"megatron": {"status": "ok", "rows": [row]}}}
    lines = page_tool.megatron(data)
    assert lines[-1] == "| swap_pass | 3.00 | 0.50x | 250.0 | 1.10x | 1.00 | yes (vs recompute) |"
    skipped = {**data, "extra": {"megatron": {"status": "skipped", "reason": "needs CUDA"}}}
    assert page_tool.megatron(skipped)[0].endswith(": needs CUDA.")


def test_the_cpu_megatron_rows_have_their_own_section_and_option(page_tool, tmp_path):
    row = {"method": "recompute", "status": "ok", "peak_bytes": 1 << 20, "memory_ratio": 0.5,
           "step_s": 0.1, "time_ratio": 1.0, "swapped_out_bytes": 0, "exact": True,
           "exact_vs": "none"}
    (tmp_path / "m.json").write_text(json.dumps(
        {**_bench_json(), "extra": {"megatron": {"status": "ok", "rows": [row]}}}))
    page = tmp_path / "results.md"
    page.write_text(PAGE + "<!-- results_page: megatron-cpu -->\n"
                    "<!-- /results_page: megatron-cpu -->\n")
    page_tool.main(["--page", str(page), "--megatron-cpu", str(tmp_path / "m.json")])
    assert "| recompute | 1.00 | 0.50x | 100.0 | 1.00x | 0.00 | yes (vs none) |" in page.read_text()


def test_the_graph_rows_give_the_cut_in_mib_and_in_layer_inputs(page_tool):
    meta = {**_bench_json()["meta"], "layers": 4, "hidden": 64, "batch": 8, "seq": 512,
            "inner": "inductor"}
    row = {"row": "layer inputs, checkpointing", "reference_peak_bytes": 50 << 20,
           "peak_bytes": 48 << 20, "cut_layer_inputs": 2.0, "bitwise": True,
           "max_relative_difference": 0.0}
    lines = page_tool.graph_peaks({"rows": [row], "meta": meta})
    assert lines[-1] == ("| layer inputs, checkpointing | 50.00 | 48.00 | 0.960x | 2.00 | 2.00 "
                         "| yes |")


GPU_PAGE = "".join(f"<!-- results_page: {name} -->\nold {name}\n<!-- /results_page: {name} -->\n"
                   for name in ("gpu-stages", "gpu-headline", "gpu-peaks", "gpu-capacity"))


def _headline_json() -> dict:
    rows = [MethodResult("no_swap", "no swap", "ok", step_s=0.1, peak_bytes=40 << 20,
                         memory_ratio=1.0, time_ratio=1.0, time_vs_recompute=0.75),
            MethodResult("recompute", "full recompute", "ok", reference="no_swap",
                         step_s=0.133, peak_bytes=8 << 20, memory_ratio=0.2, time_ratio=1.33,
                         time_vs_recompute=1.0, losses_match=True, max_loss_diff=0.0),
            MethodResult("eager_swap", EAGER, "ok", reference="no_swap", step_s=0.14,
                         peak_bytes=4 << 20, memory_ratio=0.1, time_ratio=1.4,
                         time_vs_recompute=1.05, losses_match=True, max_loss_diff=0.0,
                         d2h_gbs=40.0, h2d_gbs=45.0),
            MethodResult("hf_offload", "HF checkpointing + offload", "ok", step_s=0.2,
                         peak_bytes=5 << 20, memory_ratio=0.125, time_ratio=2.0,
                         time_vs_recompute=1.5, d2h_gbs=20.0, h2d_gbs=30.0)]
    return {"meta": _bench_json()["meta"], "rows": [r.to_json() for r in rows],
            "anchor": {"status": "ok", "what": "pinned host <-> device copy", "chunks": 7,
                       "chunk_bytes": 32 << 20, "d2h_gbs": 50.0, "h2d_gbs": 50.0}}


def test_the_gpu_check_folder_makes_the_gpu_tables(page_tool, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "headline.json").write_text(json.dumps(_headline_json()))
    stages = [{"stage": "headline", "limit_s": 150, "seconds": 61, "exit": 0, "status": "passed",
               "finished": "2026-12-04 10:00 UTC", "files": ["headline.json"]},
              {"stage": "races", "limit_s": 110, "seconds": 110, "exit": 124,
               "status": "time limit", "finished": "2026-12-04 10:02 UTC", "files": []}]
    (out / "stages.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stages))
    (out / "accelerator-peaks.json").write_text(json.dumps({
        "test": "compiled forward", "layers": 6, "batch": 4, "seq": 1024, "hidden": 1024,
        "layer_input_bytes": 16 << 20,
        "without_swap": {"allocated": 200 << 20, "reserved": 260 << 20},
        "with_swap": {"allocated": 120 << 20, "reserved": 200 << 20}}))
    page = tmp_path / "results.md"
    page.write_text(GPU_PAGE)
    page_tool.main(["--page", str(page), "--gpu-check", str(out)])
    lines = page.read_text().splitlines()
    assert "| races | 110 | 110 | time limit | 124 | - |" in lines
    assert any(line.startswith("Command: `scripts/gpu_check.sh`. Last stage finished "
                               "2026-12-04 10:02 UTC; the stage limits listed add up to 260 s.")
               for line in lines)
    # time against full recompute; GB/s against the plain pinned copy (50 GB/s both ways)
    assert (f"| {EAGER} | 4.00 | 0.10x | 140.0 | 1.05x | 40.00 | 0.80x | 45.00 | 0.90x "
            "| exact |") in lines
    assert ("| HF checkpointing + offload | 5.00 | 0.12x | 200.0 | 1.50x | 20.00 | 0.40x | 30.00 "
            "| 0.60x | not compared |") in lines
    assert "| reserved | 260.00 | 200.00 | 3.75 |" in lines
    assert "old gpu-capacity" in lines  # no capacity.json: that section stays as it was


def test_gpu_check_wants_a_folder(page_tool, tmp_path):
    with pytest.raises(SystemExit, match="is not a folder"):
        page_tool.main(["--page", str(tmp_path / "p.md"), "--gpu-check", str(tmp_path / "none")])
