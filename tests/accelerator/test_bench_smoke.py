"""The bench on the test accelerator, as a smoke test: every row runs on the device code path,
HF's own offload flag included (it needs pinned memory, which a CPU-only build lacks). Times
measured there mean nothing; only status, exactness and the swap's own counters are asserted."""

from __future__ import annotations

from swap_pass.tools.bench.methods import BenchContext
from swap_pass.tools.bench.presets import get_preset
from swap_pass.tools.bench.run import run_bench

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

SMALL = get_preset("tiny").resized(num_layers=4, seq=64, batch=2, warmup_steps=1, timed_steps=1)


def test_bench_rows_run_on_the_device_and_hf_offload_with_them(dev) -> None:
    report = run_bench(SMALL, BenchContext(dev), methods=["no_swap", "recompute", "eager_swap",
                                                         "save_on_cpu", "hf_offload"],
                       smart_rows=False, host_rows=False)
    rows = {r.key: r for r in report.rows}
    assert all(r.status == "ok" for r in rows.values()), {k: r.reason for k, r in rows.items()}
    assert rows["eager_swap"].losses_match is True and rows["recompute"].losses_match is True
    assert rows["eager_swap"].swapped_out_bytes > 0 and rows["eager_swap"].peak_host_bytes > 0
    assert rows["hf_offload"].peak_bytes < rows["no_swap"].peak_bytes
