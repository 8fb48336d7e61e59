"""The Megatron rows of ``swap-pass bench --megatron``, run on a CPU under the test shims.

megatron-core's RNG tracker and schedules need CUDA, so ``swap-pass bench --megatron`` skips its
rows on a CPU. This runs the same rows (none, recompute, swap_pass; Megatron's own offloading
needs CUDA streams) under ``tests/integrations/megatron_cpu.py``'s shims, with the sizes
``tests/integrations/test_megatron_bench.py`` uses, and writes a JSON file in the bench's format
for ``scripts/results_page.py --megatron-cpu``.

Usage (megatron-core installed, from the checkout's root):
    PYTHONPATH=. python scripts/megatron_cpu_rows.py --json megatron-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swap_pass.tools.bench import megatron as bench_megatron  # noqa: E402 - after the path
from swap_pass.tools.bench.measure import intra_op_threads  # noqa: E402
from swap_pass.tools.bench.run import describe_machine, load_average, source_build  # noqa: E402
from tests.integrations import megatron_cpu  # noqa: E402

SIZES = bench_megatron.MegatronBenchSizes(num_layers=4, hidden=64, heads=4, ffn=128, vocab=128,
                                          seq=256, micro_batch=2, micro_batches=2, steps=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the rows")
    args = parser.parse_args(argv)
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    load_before, build = load_average(), source_build()
    with intra_op_threads(1), megatron_cpu.cpu_shims():
        megatron_cpu.init_parallel()
        rows = bench_megatron.megatron_rows(torch.device("cpu"), SIZES,
                                            methods=("none", "recompute", "swap_pass"))
    meta = {"command": f"python scripts/megatron_cpu_rows.py --json {args.json}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe_machine(torch.device("cpu")), "torch": torch.__version__,
            "build": build, "load_avg_1m": [load_before, load_average()],
            "sizes": dataclasses.asdict(SIZES)}
    Path(args.json).write_text(json.dumps(
        {"meta": meta, "extra": {"megatron": {"status": "ok", "reason": "", "rows": rows}}},
        indent=1))
    print("\n".join(bench_megatron.format_megatron({"status": "ok", "rows": rows})))
    return 0 if all(r["status"] == "ok" and r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
