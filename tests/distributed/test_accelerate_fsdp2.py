"""accelerate's FSDP2 plugin with ``activation_checkpointing_offload=True``, served by swap_pass,
on 2 gloo ranks (CPU).

accelerate's ``prepare`` wraps each decoder layer as ``offload_wrapper(checkpoint_wrapper(layer))``
and shards the model with ``fully_shard``; ``enable_swap_layer_input`` on the prepared model then
checkpoints each layer without ``save_on_cpu`` and swaps its input instead. One spawned process
pair trains the same tiny Qwen2 for three SGD steps that way and with checkpointing alone (no
offload, no swap). Per rank: every loss bitwise the same (``float.hex``), every parameter's local
shard after the last step ``torch.equal``, the layers still ``OffloadWrapper``s, no checkpointed
layer run under saved-tensor hooks, exactly the inputs of every layer but the last swapped out
at every step (the last layer's backward runs first, so its input stays), and freed on the
device. accelerate shards the checkpoint wrapper inside each ``OffloadWrapper``, whose FSDP2
pre-forward hook hands the layer an alias of its input: the swap goes on that inner module, where
the alias is the tensor the checkpoint saves.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import accelerate_worker as worker
from tests.distributed.spawn import spawn_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(300)]

RANKS = 2
# One layer input: [batch, seq, hidden] float32; all but the last layer's swapped at each step.
LAYER_INPUT = worker.BATCH * worker.SEQ * worker.DIM * 4
SWAPPED = worker.LAYERS - 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    out = tmp_path_factory.mktemp("accelerate_fsdp2")
    reports = [r[worker.SETUP] for r in spawn_ranks(worker.run, RANKS, out, seconds=240)]
    for rank, report in enumerate(reports):
        assert "error" not in report, (rank, report.get("error"))
    return out, reports


def _params(out, rank: int, run: str) -> dict[str, torch.Tensor]:
    """The run's local shards by the layer's own parameter names: without the
    ``_checkpoint_wrapped_module.`` of each wrapper (one under checkpointing, two under offload)."""
    saved = torch.load(out / f"rank{rank}-{run}.pt", weights_only=True)
    return {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in saved.items()}


def test_swapped_offload_is_bitwise_the_run_without_offload(run_dir):
    """Losses and every local parameter shard after the last step equal bitwise: swap_pass's
    checkpoint without ``save_on_cpu`` computes exactly what checkpointing alone does."""
    out, reports = run_dir
    for rank, report in enumerate(reports):
        got, ref = report["offload"], report["plain"]
        assert len(got["losses"]) == worker.STEPS
        assert got["losses"] == ref["losses"], rank
        got_params, ref_params = _params(out, rank, "offload"), _params(out, rank, "plain")
        assert len(got_params) == len(ref_params) == 39, rank
        assert got_params.keys() == ref_params.keys(), rank
        unequal = [name for name, p in got_params.items() if not torch.equal(p, ref_params[name])]
        assert unequal == [], (rank, unequal)


def test_offload_wrappers_are_served_by_the_swap(run_dir):
    """The layers stay accelerate's ``OffloadWrapper``s (the reference's are plain checkpoint
    wrappers); each checkpointed layer's forward ran without saved-tensor hooks (none of
    ``save_on_cpu``'s), once per layer and step; every layer input but the last was swapped out at
    every step; ``remove()`` gave each wrapper its own ``forward`` back."""
    _, reports = run_dir
    for rank, report in enumerate(reports):
        got, ref = report["offload"], report["plain"]
        assert len(got["layer_classes"]) == worker.LAYERS
        assert all("OffloadWrapper" in name for name in got["layer_classes"]), (rank, got)
        assert not any("OffloadWrapper" in name for name in ref["layer_classes"]), (rank, ref)
        assert got["under_saved_tensor_hooks"] == [False] * (worker.STEPS * worker.LAYERS), rank
        assert got["swapped_out_bytes"] == worker.STEPS * SWAPPED * LAYER_INPUT, (rank, got)
        assert ref["swapped_out_bytes"] == 0, (rank, ref)
        assert got["own_forward_back"], rank


def test_swapped_layer_inputs_are_released(run_dir):
    """The inputs swapped out are also freed on the device: at the end of each forward every
    layer input but the last is off it, as under ``save_on_cpu``, with nothing kept and no
    warning."""
    _, reports = run_dir
    for rank, report in enumerate(reports):
        got = report["offload"]
        assert got["skipped_bytes"] == {} and got["swap_warnings"] == [], (rank, got)
        assert got["peak_device_bytes_released"] == SWAPPED * LAYER_INPUT, (rank, got)
