"""The Megatron rows of ``swap-pass bench --megatron``.

On CPU they run only under the test shims (megatron-core's RNG tracker and schedules need CUDA):
the swap_pass, recompute and none rows on a small GPTModel, through Megatron's own
``get_forward_backward_func()``. Megatron's fine-grained offloading row needs CUDA streams and
pinned memory; ``swap-pass bench --megatron`` on a GPU runs the full set.
"""

from __future__ import annotations

import logging

import pytest
import torch

from swap_pass.tools.bench import megatron as bench_megatron


def test_section_says_why_it_does_not_run_here():
    section = bench_megatron.megatron_section(torch.device("cpu"))
    assert section["status"] == "skipped" and section["rows"] == []
    assert "megatron-core is not installed" in section["reason"] or "need CUDA" in section["reason"]
    assert bench_megatron.format_megatron(section) == [
        f"Megatron rows: SKIPPED: {section['reason']}"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_rows_on_cpu_are_exact_and_swap_saves_memory():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from tests.integrations import megatron_cpu as mc

    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    sizes = bench_megatron.MegatronBenchSizes(num_layers=4, hidden=64, heads=4, ffn=128,
                                              vocab=128, seq=256, micro_batch=2, micro_batches=2,
                                              steps=1)
    with mc.cpu_shims():
        mc.init_parallel()
        rows = bench_megatron.megatron_rows(torch.device("cpu"), sizes,
                                            methods=("none", "recompute", "swap_pass"))
    by = {r["method"]: r for r in rows}
    assert all(r["status"] == "ok" and r["exact"] is True for r in rows), rows
    assert by["swap_pass"]["exact_vs"] == "recompute"
    assert by["swap_pass"]["swapped_out_bytes"] > 0 and by["recompute"]["swapped_out_bytes"] == 0
    assert by["recompute"]["peak_bytes"] < by["none"]["peak_bytes"]
    assert by["swap_pass"]["peak_bytes"] < by["recompute"]["peak_bytes"]
    lines = bench_megatron.format_megatron({"status": "ok", "rows": rows})
    assert len(lines) == 2 + 3 and all("yes (vs" in line for line in lines[2:])
