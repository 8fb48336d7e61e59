"""Pipeline parallel for real: 2 gloo ranks on CPU, torch.distributed.pipelining schedules.

Each backward of a layer must pair with its own micro-batch's forward (several in flight per
layer). The worker (``pp_worker.py``) compares every loss and gradient to the same schedule
without swap; this test spawns it and asserts on what both ranks report.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from tests.distributed.spawn import free_port, spawn_with_deadline
from tests.eager import pp_worker

# Per rank and step: 4 micro-batches x the swapped layers of the rank (4 layers per rank; the
# last keeps its input, and so does a first layer fed the user's raw micro-batch views; see
# pp_worker.expected_swaps_per_step). The first step also swaps in the
# stage's one extra grad-enabled forward (shape inference), whose graph is dropped: the "clean"
# check shows its groups went with it.
RUNS = pp_worker.RUNS


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    out = tmp_path_factory.mktemp("pp")
    spawn_with_deadline(pp_worker.run, (2, free_port(), str(out)), nprocs=2, seconds=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("run", RUNS)
def test_pipeline_schedule_bitwise_equal_to_no_swap(pp_results, run):
    for rank, results in enumerate(pp_results):
        res = results[run]
        assert res["losses_equal"] and res["grads_equal"], (rank, res)
        first, second = res["outs_per_step"]
        per_step = pp_worker.expected_swaps_per_step(run, rank)
        assert per_step > 0
        assert (res["ref_swap_outs"] == 0 and first >= per_step
                and second - first == per_step), (rank, res)
        assert res["clean"] and res["inputs_intact"], (rank, res)
    assert pp_results[1][run]["n_losses"] == 2 * pp_worker.MICROBATCHES  # last stage saw every loss
