"""Whole-model ``torch.compile(model, backend=make_swap_backend("aot_eager"))`` on DDP, FSDP2,
tensor + sequence parallel and classic tensor parallel, 2 gloo ranks (CPU), in layer-input mode
and (FSDP2, TP + SP) in budget mode (``memory_budget=0.5``, a cost model in which every copy
hides).

Each setup trains three optimizer steps against the same whole-model compile with the plain
``aot_eager`` backend: losses, every gradient and every parameter ``torch.equal`` on every rank.

* DDP (the DDP module compiled): one graph (the model has one gradient bucket, so DDP's graph
  split does not cut it); the layer inputs are swapped, the bytes released asserted.
* Classic TP: one graph; the first block reads the embedding's all-reduce result through a view
  the partitioner does not save, and the saved result itself is swapped in its place.
* TP + SP: Dynamo traces the whole model (DTensors, the plans' hooks) into one graph; the swap
  ops are in it, and the bytes they release on each rank are asserted.
* FSDP2: Dynamo runs ``fully_shard``'s hooks eagerly, so the only graph is one block's forward
  (shared by every block; the embedding, the final norm and the output run eagerly). No graph
  holds two layers: layer-input mode swaps nothing, counts the saved bytes under ``no_layers``
  and warns once, naming ``compile_layers``; budget mode swaps inside that block graph (every
  block's call of it), exact, and warns that the budget is not reached (a graph's own inputs,
  the block input among them, are never swapped). The same with ``checkpoint_wrapper`` on every
  block (the one graph is a checkpointed block's forward).

One spawned process pair for the seven setups; the reference compile runs once per
parallelism.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import dist_worker, models
from tests.distributed.spawn import spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(900)]

STEPS = dist_worker.STEPS
LAYER_INPUT = models.BATCH * models.SEQ * models.DIM * 4  # float32 [batch, seq, dim]
SP_INPUT = LAYER_INPUT // 2  # this rank's sequence shard


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return spawn_ranks(dist_worker.run, 2, tmp_path_factory.mktemp("compile_model"),
                       dist_worker.MODEL_COMPILE_SETUPS, seconds=840)


def _each_rank(reports: list[dict], setup: str):
    for rank, report in enumerate(reports):
        res = report[setup]
        assert "error" not in res, res.get("error")
        assert res["losses_equal"] and res["grads_equal"] and res["params_equal"], (rank, res)
        assert res["n_params"] == 39 and res["ref_outs"] == 0
        assert res["clean"] and res["intact"], (rank, res)
        yield rank, res


def _swapped_per_step(res: dict, calls: int) -> int:
    """Swap-outs per step: every partition's swapped tensors, ``calls`` runs of it a step."""
    per_step = calls * sum(n for _, n, _ in res["compiled"]["partitions"])
    assert per_step > 0 and res["outs"] == [per_step * (s + 1) for s in range(STEPS)], res
    return per_step


@pytest.mark.parametrize("setup", ["ddp-compile-model", "tp-classic-compile-model"])
def test_ddp_and_classic_tp_whole_model_swap_every_layer_input_but_the_last_exactly(reports,
                                                                                    setup):
    for rank, res in _each_rank(reports, setup):
        layers = models.LAYERS - 1
        assert res["compiled"]["graphs"] == 1, (rank, res)
        assert res["compiled"]["partitions"] == [["layer_input", layers, layers * LAYER_INPUT]]
        _swapped_per_step(res, calls=1)
        assert res["released"] == layers * LAYER_INPUT, (rank, res)
        assert res["skipped"] == {} and res["warnings"] == [], (rank, res)


def test_tp_sp_whole_model_one_graph_swaps_layer_inputs_exactly(reports):
    for rank, res in _each_rank(reports, "tp-sp-compile-model"):
        assert res["compiled"]["graphs"] == 1 and res["compiled"]["breaks"] == 0, (rank, res)
        layers = models.LAYERS - 1  # the last block's input: backward needs it at once
        assert res["compiled"]["partitions"] == [["layer_input", layers, layers * SP_INPUT]]
        _swapped_per_step(res, calls=1)
        assert res["released"] == layers * SP_INPUT, (rank, res)
        assert res["skipped"] == {} and res["warnings"] == [], (rank, res)


def test_tp_sp_whole_model_budget_mode_swaps_more_than_layer_inputs_exactly(reports):
    for rank, res in _each_rank(reports, "tp-sp-compile-budget"):
        (mode, swapped, nbytes), = res["compiled"]["partitions"]
        assert mode == "budget" and swapped > models.LAYERS - 1, (rank, res)
        _swapped_per_step(res, calls=1)
        assert res["released"] == nbytes > (models.LAYERS - 1) * SP_INPUT, (rank, res)
        assert res["skipped"] == {} and res["warnings"] == [], (rank, res)


@pytest.mark.parametrize("setup", ["fsdp2-compile-model", "fsdp2-ac-compile-model"])
def test_fsdp2_whole_model_swaps_nothing_counts_it_and_names_compile_layers(reports, setup):
    for rank, res in _each_rank(reports, setup):
        assert res["compiled"]["partitions"] == [["layer_input", 0, 0]], (rank, res)
        assert res["outs"] == [0] * STEPS and res["released"] == 0, (rank, res)
        assert list(res["skipped"]) == ["no_layers"] and res["skipped"]["no_layers"] > 0
        assert len(res["warnings"]) == 1, (rank, res["warnings"])
        assert "fully_shard" in res["warnings"][0] and "compile_layers" in res["warnings"][0]


def test_fsdp2_whole_model_budget_mode_swaps_inside_each_block_graph_exactly(reports):
    for rank, res in _each_rank(reports, "fsdp2-compile-budget"):
        (mode, swapped, nbytes), = res["compiled"]["partitions"]
        assert mode == "budget" and swapped > 0, (rank, res)
        _swapped_per_step(res, calls=models.LAYERS)  # one block graph, called by every block
        assert res["released"] == models.LAYERS * nbytes, (rank, res)
        assert res["skipped"] == {}, (rank, res)
        assert len(res["warnings"]) == 1 and "not reached" in res["warnings"][0], (rank, res)
