"""SmartSwap on DDP, FSDP2 (also with ``checkpoint_wrapper``), tensor + sequence parallel,
classic tensor parallel and pipeline-parallel (``ScheduleGPipe``, ``Schedule1F1B``, one stage per
rank) models: 2 gloo ranks spawned for real; pipeline x FSDP2 (2 stages x 2-way ``fully_shard``)
and pipeline x classic tensor parallel (2 stages x 2-way TP) on 4 more.

The worker (``dist_worker.py``) trains each setup with and without SmartSwap (``memory_budget=0.5``)
for 4 AdamW steps; here every rank must report: every loss, gradient and parameter bitwise equal,
bytes released in every step, the resident saved bytes of the planned steps within the budget,
nothing left on the host, nothing kept as a tensor subclass, and, per setup, what SmartSwap must
(not) touch: FSDP2's all-gathered parameter storages never tracked, saved DTensor activations
freed through their local tensors, saved ``AsyncCollectiveTensor`` s through their waited results,
and how many micro-batches held saved tensors at once (pipeline schedules; one elsewhere).
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from tests.distributed import pp_fsdp_worker
from tests.distributed.spawn import free_port, spawn_with_deadline
from tests.eager import pp_worker
from tests.smart import dist_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    out = tmp_path_factory.mktemp("smart_dist")
    spawn_with_deadline(dist_worker.run, (2, free_port(), str(out)), nprocs=2, seconds=280)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert "error" not in r, r["error"]
    return ranks


@pytest.mark.parametrize("run", [r for r in dist_worker.RUNS if r != "pp-1f1b"])
def test_smartswap_is_exact_within_budget_and_releases_bytes_on_every_rank(results, run):
    check(results, run)
    for rank, per_run in enumerate(results):
        assert per_run[run]["in_flight"] == [1] * dist_worker.STEPS, (rank, per_run[run])


@pytest.fixture(scope="module")
def pp_fsdp_results(tmp_path_factory) -> list[dict]:
    """``dist_worker.PP_FSDP_RUNS`` and ``PP_TP_RUNS`` on 4 ranks: 2 pipeline stages x 2-way
    FSDP2, then x 2-way classic tensor parallel."""
    out = tmp_path_factory.mktemp("smart_pp_fsdp")
    runs = dist_worker.PP_FSDP_RUNS + dist_worker.PP_TP_RUNS
    spawn_with_deadline(dist_worker.run, (4, free_port(), str(out), runs), nprocs=4, seconds=420)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        assert "error" not in r, r["error"]
    return ranks


def test_pipeline_losses_are_the_last_stages_one_per_micro_batch(results):
    for run in ("pp-gpipe", "pp-1f1b"):
        assert [per_run[run]["n_losses"] for per_run in results] == [
            0, dist_worker.STEPS * pp_worker.MICROBATCHES]


def test_1f1b_is_exact_and_within_budget_where_micro_batches_overlap(results):
    check_1f1b(results, "pp-1f1b", [0, 1])


def test_pipeline_x_fsdp2_under_smartswap(pp_fsdp_results):
    """GPipe: exact within budget on all 4 ranks; 1F1B: as :func:`check_1f1b` per stage."""
    check(pp_fsdp_results, "pp-fsdp2-gpipe")
    check_1f1b(pp_fsdp_results, "pp-fsdp2-1f1b", [0, 0, 1, 1])
    for run in dist_worker.PP_FSDP_RUNS:
        losses = dist_worker.STEPS * pp_fsdp_worker.MICROBATCHES  # the last stage's
        assert [per_run[run]["n_losses"] for per_run in pp_fsdp_results] == [0, 0] + [losses] * 2


def test_pipeline_x_tensor_parallel_under_smartswap(pp_fsdp_results):
    """The classic TP plan on each stage (the first stage's first block gets the embedding's
    ``AsyncCollectiveTensor``): GPipe exact within budget on all 4 ranks; 1F1B as
    :func:`check_1f1b` per stage; nothing kept as skipped."""
    check(pp_fsdp_results, "pp-tp-gpipe")
    check_1f1b(pp_fsdp_results, "pp-tp-1f1b", [0, 0, 1, 1])
    for run in dist_worker.PP_TP_RUNS:
        losses = dist_worker.STEPS * pp_fsdp_worker.MICROBATCHES  # the last stage's
        assert [per_run[run]["n_losses"] for per_run in pp_fsdp_results] == [0, 0] + [losses] * 2
        for rank, per_run in enumerate(pp_fsdp_results):
            assert per_run[run]["skipped"] == {}, (rank, per_run[run])


def check_1f1b(results: list[dict], run: str, stages: list[int]) -> None:
    """``Schedule1F1B`` on 2 stages (``stages``: each rank's): the first stage runs 2
    micro-batches' forwards before the first backward and one forward between backwards after
    that, so 2 micro-batches hold saved tensors at once there; the last stage runs each backward
    right after its forward. Each micro-batch runs a plan made for its own saved tensors; where
    they overlap, what the earlier one kept on the device leaves when the next begins (Note:
    [Micro-batches in flight] in executor.py), and the step's resident saved bytes stay within
    ``memory_budget`` of the step's unswapped peak (each plan's budget is that fraction of its
    own micro-batch's peak). Where they do not, nothing is evicted and the step is within the
    plan's budget."""
    for rank, (per_run, stage) in enumerate(zip(results, stages, strict=True)):
        res = per_run[run]
        in_flight = 2 - stage  # stages from this one to the last
        assert res["in_flight"] == [in_flight] * dist_worker.STEPS, (rank, res)
        assert res["warnings"] == [], (rank, res)
        if in_flight == 1:
            check_within_budget(res, rank)
            assert res["evicted"] == [0] * dist_worker.STEPS, (rank, res)
            continue
        check_exact(res, rank)
        stable = [p for p, s in zip(res["peaks"], res["stages"], strict=True) if s == "stable"]
        budget = dist_worker.BUDGET * max(res["unswapped_peaks"])
        assert max(stable) <= budget < max(res["unswapped_peaks"]), (rank, res)
        assert max(stable) <= max(res["plan_budgets"]), (rank, res)
        planned = [e for e, s in zip(res["evicted"], res["stages"], strict=True) if s == "stable"]
        assert all(e > 0 for e in planned), (rank, res)


def check(results: list[dict], run: str, *, binding: bool = True) -> None:
    """What every run must show on every rank (see the module docstring).

    ``binding``: the budget is below the measured unswapped peak of saved activations (else
    only the planned steps' measured peak is, and within the budget)."""
    for rank, per_run in enumerate(results):
        check_within_budget(per_run[run], rank, binding=binding)


def check_within_budget(res: dict, rank: int, *, binding: bool = True) -> None:
    """One rank's run: :func:`check_exact`, and the planned steps' resident saved bytes within
    the budget (see :func:`check` for ``binding``)."""
    check_exact(res, rank)
    stable = [p for p, s in zip(res["peaks"], res["stages"], strict=True) if s == "stable"]
    ceiling = res["budget_bytes"] if binding else max(stable)
    assert all(p <= res["budget_bytes"] for p in stable), (rank, res)
    assert ceiling < max(res["unswapped_peaks"]), (rank, res)


def check_exact(res: dict, rank: int) -> None:
    """One rank's run: every loss, gradient and parameter bitwise equal, bytes released in every
    step, two planned steps of a feasible plan, nothing left on the host, the batch intact,
    nothing kept as a tensor subclass."""
    assert res["losses_equal"] and res["grads_equal"] and res["params_equal"], (rank, res)
    assert all(b > 0 for b in res["released"]), (rank, res["released"])
    assert res["stages"][-2:] == ["stable", "stable"] and res["feasible"], (rank, res)
    assert res["host_bytes_in_use"] == 0 and res["inputs_intact"], (rank, res)
    assert "subclass" not in res["skipped"], (rank, res["skipped"])


@pytest.mark.parametrize("run", [r for r in dist_worker.RUNS if r.startswith("fsdp2")])
def test_fsdp2_all_gathered_parameters_are_never_taken_for_activations(results, run):
    for rank, per_run in enumerate(results):
        res = per_run[run]
        assert res["params_saved"] > 0 and res["params_tracked"] == 0, (rank, res)


def test_saved_dtensor_activations_are_freed_through_their_local_tensors(results):
    for rank, per_run in enumerate(results):
        freed = per_run["tp"]["dtensors_freed"]
        assert all(n > 0 for n, _ in freed), (rank, freed)


def test_saved_async_collective_tensors_are_freed_through_their_waited_results(results):
    """Classic TP: the first block's norm saves the embedding's all-reduce result, an
    ``AsyncCollectiveTensor`` (Note: [Saved AsyncCollectiveTensors] in saved.py)."""
    for rank, per_run in enumerate(results):
        freed = per_run["tp-classic"]["collectives_freed"]
        assert all(total > 0 for _, total in freed), (rank, freed)
        assert all(n > 0 for n, _ in freed[:2]), (rank, freed)  # conservative steps: all go
