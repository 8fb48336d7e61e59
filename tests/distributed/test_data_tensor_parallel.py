"""DDP, FSDP2 and tensor parallel on 2 gloo ranks (CPU), with and without activation checkpointing.

One spawned process pair runs every setup (``dist_worker.SETUPS``; ``"docs-recipe"`` enables
swap with docs/distributed.md's recipe block, as written, on the TP + SP model); each setup trains
three optimizer steps without and with ``enable_swap_layer_input``. Per rank: losses, every gradient
of every step and every parameter after the last step equal (``torch.equal``, local shards of
DTensors), every block's input but the last off the device at the end of forward, the bytes
released on this rank exactly those layer inputs' (under sequence parallel, this rank's shard),
nothing pending, the batch intact, no warning.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import dist_worker, models
from tests.distributed.spawn import spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(900)]

# One layer input per rank: [batch, seq, dim] float32; sequence parallel keeps half the sequence.
LAYER_INPUT = models.BATCH * models.SEQ * models.DIM * 4
SWAPPED = models.LAYERS - 1  # the last block keeps its input


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return spawn_ranks(dist_worker.run, 2, tmp_path_factory.mktemp("dist"), dist_worker.SETUPS)


@pytest.mark.parametrize("setup", dist_worker.SETUPS)
def test_exact_and_swapped_on_every_rank(reports, setup):
    check(reports, setup)


def check(reports: list[dict], setup: str) -> None:
    """What every setup must show on every rank (see the module docstring)."""
    sp = setup.startswith("tp-sp") or setup == "docs-recipe"
    per_input = LAYER_INPUT // 2 if sp else LAYER_INPUT
    for rank, report in enumerate(reports):
        res = report[setup]
        assert "error" not in res, res.get("error")
        assert res["losses_equal"] and res["grads_equal"] and res["params_equal"], (rank, res)
        assert res["n_params"] == 39
        assert res["ref_outs"] == 0
        assert res["outs"] == [SWAPPED * (s + 1) for s in range(dist_worker.STEPS)], (rank, res)
        assert res["freed"] == [True] * SWAPPED + [False], (rank, res)
        assert res["released"] == SWAPPED * per_input, (rank, res)
        assert res["swapped_in"] == dist_worker.STEPS * SWAPPED * per_input, (rank, res)
        assert res["skipped"] == {} and res["warnings"] == [], (rank, res)
        assert res["clean"] and res["intact"], (rank, res)

