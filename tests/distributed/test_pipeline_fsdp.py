"""Pipeline parallel x FSDP2 and x tensor parallel on 4 gloo ranks (CPU): 2 stages x 2-way
``fully_shard`` or 2-way TP, one 2-D mesh each.

One spawned group of 4 ranks runs ``ScheduleGPipe`` and ``Schedule1F1B`` with FSDP2
(``pp_fsdp_worker.SCHEDULES``), with the classic TP plan (``TP_SCHEDULES``) and with tensor +
sequence parallel (``SP_SCHEDULES``, DTensor activations across the stage boundary), each three
optimizer steps of 4 micro-batches without and with ``enable_swap_layer_input`` on each stage's
module. Per rank: the last stage's losses, every gradient of every step and every parameter after
the last step ``torch.equal`` (local shards); each stage's block inputs but the last off the device
at the end of its forward (on the second stage also the first block's, counted and warned, see
:func:`swapped_per_microbatch`); bytes released on this rank exactly the block inputs of the
micro-batches the schedule has in flight at once; nothing pending; the batch intact; no other
warning. The FSDP2 schedules again with each stage's blocks compiled by ``swap_pass.compile_layers``
(aot_eager), against the same per-block compile without swap, with the same checks; the classic TP
ones compiled so fail in torch, without swap too (``test_compile_layers.py``), and run with the
first stage's first block left eager.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import models
from tests.distributed import pp_fsdp_worker as worker
from tests.distributed.spawn import spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

RANKS = 4
# One micro-batch's block input: [BATCH / MICROBATCHES, seq, dim] float32.
LAYER_INPUT = worker.BATCH // worker.MICROBATCHES * models.SEQ * models.DIM * 4


def swapped_per_microbatch(stage: int) -> int:
    """Block inputs swapped per micro-batch on ``stage``.

    Each stage's last block keeps its input (backward starts there at once). On a stage after the
    first, the first block's input stays too, counted as ``shared_storage`` with one warning:
    FSDP2's pre-forward hooks pass every input that needs grad through an autograd Function that
    returns it as is, once for the stage module and once for the block, so the block receives an
    alias of the received activation while the stage's own alias of it (the stage's ``forward``
    argument) is still referenced, a holder the swap cannot guard (Note: [Whole aliases of a
    received leaf] in ``swap_pass/runtime/freeing.py``). Without FSDP the received leaf itself
    is swapped (``tests/eager/test_pipeline.py``).
    """
    return worker.LAYERS_PER_STAGE - 1 - (stage > 0)


def in_flight(schedule: str, stage: int) -> int:
    """Micro-batches whose forward has run and whose backward has not, at most, on ``stage``:
    GPipe runs every forward first; 1F1B's warm-up runs ``stages - stage`` forwards."""
    if "gpipe" in schedule:
        return worker.MICROBATCHES
    return min(worker.MICROBATCHES, worker.STAGES - stage)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return spawn_ranks(worker.run, RANKS, tmp_path_factory.mktemp("pp_fsdp"),
                       [*worker.SCHEDULES, *worker.TP_SCHEDULES, *worker.COMPILED_SCHEDULES,
                        *worker.TP_LATER_COMPILED, *worker.SP_SCHEDULES], seconds=540)


@pytest.mark.parametrize("schedule", worker.SCHEDULES + worker.COMPILED_SCHEDULES)
def test_pipeline_x_fsdp2_exact_and_swapped_on_every_rank(reports, schedule):
    """Eager, and each stage's blocks compiled by ``compile_layers`` (aot_eager; Dynamo compiled
    them without a graph break) against the same per-block compile without swap: the same
    swaps, the same input kept on the second stage."""
    for rank, report in enumerate(reports):
        res, stage = report[schedule], report["stage"]
        assert (stage, report["dp_rank"]) == divmod(rank, 2)
        assert "error" not in res, res.get("error")
        assert res["losses_equal"] and res["grads_equal"] and res["params_equal"], (rank, res)
        last = stage == worker.STAGES - 1
        assert res["n_losses"] == [worker.MICROBATCHES if last else 0] * worker.STEPS
        assert res["grads_present"] and res["n_params"] > 0, (rank, res)
        assert res["ref_outs"] == 0
        per_mb = swapped_per_microbatch(stage)
        # torch 2.13's first step also runs the stage's metadata inference: one more micro-batch's
        # forward and backward with real tensors and grad on (releases that infer shapes under
        # no_grad swap nothing there).
        # Swaps started: every block's input but the last (the kept one is started, then kept
        # when it is to be freed).
        started = worker.LAYERS_PER_STAGE - 1
        inference = res["outs"][0] // started - worker.MICROBATCHES
        assert inference in (0, 1), (rank, res)
        forwards = [worker.MICROBATCHES * (s + 1) + inference for s in range(worker.STEPS)]
        assert res["outs"] == [started * n for n in forwards], (rank, res)
        assert res["freed"] == [stage == 0] + [True] * (per_mb - (stage == 0)) + [False], (
            rank, res)
        assert res["released"] == in_flight(schedule, stage) * per_mb * LAYER_INPUT, (rank, res)
        assert res["swapped_in"] == per_mb * forwards[-1] * LAYER_INPUT, (rank, res)
        kept = {"shared_storage": forwards[-1] * LAYER_INPUT} if stage > 0 else {}
        assert res["skipped"] == kept, (rank, res)
        assert len(res["warnings"]) == (stage > 0), (rank, res)
        assert all("fully_shard" in w for w in res["warnings"]), (rank, res)
        assert res["clean"] and res["intact"], (rank, res)
        if schedule.endswith("-compiled"):
            compiled = res["compiled"]
            assert compiled["graphs"] >= 1 and compiled["breaks"] == 0, (rank, compiled)


@pytest.mark.parametrize("schedule",
                         worker.TP_SCHEDULES + worker.TP_LATER_COMPILED + worker.SP_SCHEDULES)
def test_pipeline_x_tensor_parallel_exact_and_swapped_on_every_rank(reports, schedule):
    """2 stages x the classic TP plan on 2 ranks each: every block input but each stage's last is
    swapped, the first stage's first (an ``AsyncCollectiveTensor``, the embedding's all-reduce)
    and the second stage's first (the received activation) included; nothing kept or warned.

    ``-compiled-later``: each stage's blocks compiled by ``compile_layers`` (aot_eager; no graph
    break), the first stage's first left eager and out of the swap (``layers=``; compiled, its
    backward fails in torch without swap too, ``test_compile_layers.py``), against the same
    per-block compile without swap.

    ``sp-``: tensor + sequence parallel, DTensor activations between blocks and across the stage
    boundary (the second stage re-wraps what it receives as a DTensor, ``get_mesh``): each block
    input's local sequence shard is swapped, half a full input's bytes."""
    later = schedule.endswith("-compiled-later")
    layer_input = LAYER_INPUT // 2 if schedule.startswith("sp-") else LAYER_INPUT
    for rank, report in enumerate(reports):
        res, stage = report[schedule], report["stage"]
        eager_first = later and stage == 0  # not a swapped layer: its input stays, uncounted
        per_mb = worker.LAYERS_PER_STAGE - 1 - eager_first
        assert "error" not in res, res.get("error")
        assert res["losses_equal"] and res["grads_equal"] and res["params_equal"], (rank, res)
        last = stage == worker.STAGES - 1
        assert res["n_losses"] == [worker.MICROBATCHES if last else 0] * worker.STEPS
        assert res["grads_present"] and res["n_params"] > 0 and res["ref_outs"] == 0, (rank, res)
        inference = res["outs"][0] // per_mb - worker.MICROBATCHES  # as in the test above
        assert inference in (0, 1), (rank, res)
        forwards = [worker.MICROBATCHES * (s + 1) + inference for s in range(worker.STEPS)]
        assert res["outs"] == [per_mb * n for n in forwards], (rank, res)
        assert res["freed"] == [not eager_first] + [True] * (per_mb - 1 + eager_first) + [False], (
            rank, res)
        assert res["released"] == in_flight(schedule, stage) * per_mb * layer_input, (rank, res)
        assert res["swapped_in"] == res["outs"][-1] * layer_input, (rank, res)
        assert res["skipped"] == {} and res["warnings"] == [], (rank, res)
        assert res["clean"] and res["intact"], (rank, res)
        if later:
            compiled = res["compiled"]
            assert compiled["graphs"] >= 1 and compiled["breaks"] == 0, (rank, compiled)

