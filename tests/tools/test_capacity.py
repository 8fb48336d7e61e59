"""``swap-pass capacity`` and ``swap-pass plan --device-memory``: the search, the caps, the
planner against measured peaks, losses against no swap, the host limit, the JSON format."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from swap_pass.tools.bench.harness import run_method
from swap_pass.tools.bench.methods import METHODS, BenchContext
from swap_pass.tools.bench.presets import PRESETS, get_preset
from swap_pass.tools.capacity.limits import device_memory_cap, parse_bytes
from swap_pass.tools.capacity.measured import run_capacity
from swap_pass.tools.capacity.planned import plan_capacity, sized_preset
from swap_pass.tools.capacity.search import largest_fitting
from swap_pass.tools.cli import main
from swap_pass.tools.memory_model import METHOD_KEYS, ModelShape, method_memory, param_count
from swap_pass.tools.models import LlamaStyleModel

MIB = 2**20
CPU = torch.device("cpu")
ROW_KEYS = {"method", "max", "peak_bytes", "need_without_swap_bytes", "exact", "step_ms", "cpu_ms"}


def test_search_finds_the_largest_fitting_size_from_any_start():
    for true, start, limit in itertools.product(range(20), range(24), (1, 7, 33)):
        def fits(n: int, true: int = true, limit: int = limit) -> bool:
            assert 1 <= n <= limit
            return n <= true

        assert largest_fitting(fits, start, limit) == min(true, limit)
    good = []
    assert largest_fitting(lambda n: good.append(n) or n <= 56, 56, 1000) == 56 and good == [56, 57]


@pytest.mark.parametrize("text, value", [("64MiB", 64 * MIB), ("80GiB", 80 * 2**30), ("1000", 1000),
                                         ("1.5KB", 1500), ("2 gb", 2 * 10**9)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "-1", "64XB", "0.1"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match=r"swap_pass\.tools\.capacity: memory size"):
        parse_bytes(text)


def test_param_count_matches_the_model():
    preset = get_preset("tiny")
    model = LlamaStyleModel(preset.model)
    assert param_count(ModelShape.from_preset(preset)) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_planner_within_15_percent_of_measured_peaks_in_bf16():
    """Each method's planned activation peak against the bench's profiled peak of the same step, in
    bf16 (the accelerator preset's dtype: norms and the loss copy to fp32). fp32: the command
    test."""
    preset = get_preset("tiny").resized(batch=1, seq=128, dtype="bf16", timed_steps=1)
    shape, budget = ModelShape.from_preset(preset), 256 * 1024
    by_key = {m.key: m for m in METHODS}
    for key in METHOD_KEYS:
        result = run_method(by_key[key], preset, BenchContext(CPU, smart_budget_bytes=budget),
                            on_error=lambda err: (_ for _ in ()).throw(err))
        planned = method_memory(shape, key, budget).activation_bytes
        assert abs(planned / result.peak_bytes - 1) <= 0.15, (key, planned, result.peak_bytes)


def test_capacity_command_small_cap_json_peaks_losses_planner(tmp_path, capsys):
    """Every reported size ran within the cap, a size more did not, losses equal no swap's."""
    out = tmp_path / "cap.json"
    rc = main(["capacity", "--preset", "tiny", "--seq", "64", "--device-memory", "3MiB",
               "--search-max", "12", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "VIRTUAL cap, CPU" in text and "planner: planned peaks within" in text
    data = json.loads(out.read_text())
    assert (data["device_memory"] == 3 * MIB and data["dim"] == "batch"
            and data["virtual_cap"] is True)
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == set(METHOD_KEYS)
    for key, row in rows.items():
        assert ROW_KEYS <= set(row)
        assert isinstance(row["max"], int) and row["max"] >= 1
        assert row["peak_bytes"] <= 3 * MIB
        assert abs(row["planned_peak_bytes"] / row["peak_bytes"] - 1) <= 0.15
        assert row["step_ms"] > 0 and row["cpu_ms"] > 0
        beyond = [p for p in row["probes"] if p["size"] == row["max"] + 1]
        assert row["max"] == 12 or (
            beyond and not beyond[0]["fits"] and beyond[0]["peak_bytes"] > 3 * MIB)
        if key != "no_swap":
            assert row["exact"] is True and row["exact_at"] == rows["no_swap"]["max"]
    assert rows["no_swap"]["exact"] is None
    assert rows["eager_swap"]["max"] >= 4 * rows["no_swap"]["max"]
    assert rows["smartswap"]["smart_budget_bytes"] > 0


def test_host_limit_stops_the_search_and_says_so():
    """recompute + swap holds (layers - 1) layer inputs on the host: 40 KiB per batch row here."""
    report = run_capacity(get_preset("tiny").resized(seq=64), CPU, 32 * MIB, methods=["eager_swap"],
                          host_limit_bytes=100 * 1024, limit=16)
    row = report.row("eager_swap")
    assert row.max == 2 and row.limited_by == "host"
    assert row.host_bytes <= 100 * 1024 and row.peak_bytes <= 32 * MIB
    assert any(p.limited_by == "host" and not p.fits for p in row.probes)


def test_cap_is_virtual_on_cpu():
    with device_memory_cap(CPU, MIB) as virtual:
        assert virtual is True


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="a real cap needs an accelerator")
@pytest.mark.accelerator
def test_real_cap_turns_an_allocation_over_it_into_out_of_memory():
    device = torch.accelerator.current_accelerator()
    with device_memory_cap(device, 64 * MIB) as virtual:
        assert virtual is False
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(256 * MIB, dtype=torch.uint8, device=device)
    torch.empty(256 * MIB, dtype=torch.uint8, device=device)  # the cap is lifted afterwards


def test_sizes_per_dim():
    tiny = get_preset("tiny")
    assert sized_preset(tiny, "batch", 5).batch == 5
    seq = sized_preset(tiny, "seq", 2000)
    assert seq.seq == 2000 and seq.model.max_seq_len == 2000
    hidden = sized_preset(tiny, "hidden", 6)
    assert hidden.model.hidden_size == 48 and hidden.model.intermediate_size == 132
    with pytest.raises(ValueError, match="dim='width' is unknown"):
        sized_preset(tiny, "width", 1)


def test_planned_table_ranks_methods_and_flags_host_limit():
    tiny = get_preset("tiny")
    rows = {r.method: r for r in plan_capacity(tiny, "batch", 64 * MIB, 2**40)}
    assert (rows["no_swap"].max < rows["recompute"].max < rows["eager_swap"].max
            <= rows["smartswap"].max)
    assert all(r.memory.peak_bytes <= 64 * MIB and r.limited_by == "device" for r in rows.values())
    starved = {r.method: r for r in plan_capacity(tiny, "batch", 64 * MIB, 4 * MIB)}
    assert (starved["smartswap"].limited_by == "host"
            and starved["smartswap"].max < rows["smartswap"].max)
    assert starved["no_swap"].max == rows["no_swap"].max


def test_plan_device_memory_command(capsys):
    rc = main(["plan", "--hidden", "4096", "--seq", "4096", "--layers", "32",
               "--device-memory", "80GiB", "--host-memory", "1GiB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "swap-pass plan --device-memory" in out and "recompute + swap" in out
    assert "warning: SmartSwap is limited by host memory" in out
    assert "host memory assumed: 1.00 GiB (--host-memory)" in out
    assert "  x cap: device memory that size needs without swap" in out  # each column explained
    rc = main(["plan", "--hidden", "4096", "--seq", "4096", "--layers", "32",
               "--device-memory", "80GiB"])
    out = capsys.readouterr().out
    assert rc == 0 and "(this machine's available memory; pass --host-memory" in out
    rc = main(["plan", "--hidden", "4096", "--seq", "4096", "--layers", "32",
               "--device-memory", "64GiB", "--optimizer", "adam", "--host-memory", "1TiB"])
    assert rc == 0 and "model state alone is 65.83 GiB" in capsys.readouterr().out


@pytest.mark.slow
def test_tiny_at_64_mib_swap_reaches_4x_the_no_swap_batch(tmp_path):
    """The documented figure: recompute + swap and SmartSwap at least 4x no swap's batch."""
    report = run_capacity(get_preset("tiny"), CPU, 64 * MIB)
    rows = {r.method: r for r in report.rows}
    assert rows["no_swap"].max >= 1
    for key in ("eager_swap", "smartswap"):
        assert rows[key].max >= 4 * rows["no_swap"].max
    for row in report.rows:
        assert row.peak_bytes <= 64 * MIB
        assert abs(row.planned_peak_bytes / row.peak_bytes - 1) <= 0.15
        assert row.exact in (None, True)


def test_presets_are_covered_by_the_memory_model():
    for preset in PRESETS.values():
        shape = ModelShape.from_preset(preset)
        for key in METHOD_KEYS:
            assert method_memory(shape, key).peak_bytes > 0
