"""One rank of the accelerate FSDP2 test: accelerate's own ``Accelerator.prepare`` on 2 gloo ranks
(CPU), its FSDP2 path (``fsdp2_apply_ac``, then ``fully_shard``) with activation checkpointing.

Two runs in one process (a spawn costs seconds of interpreter start and imports), the same model,
seeds and batches: ``"offload"`` with ``activation_checkpointing_offload=True`` (each decoder layer
wrapped as ``offload_wrapper(checkpoint_wrapper(layer))``) and ``enable_swap_layer_input`` called
on the prepared model, and ``"plain"`` with checkpointing alone and no swap. Each run writes to
``rank<r>.json`` every step's loss as ``float.hex`` (bitwise comparable), and to
``rank<r>-<run>.pt`` every parameter's local shard after the last step; the swapped run adds what
swap_pass did: bytes swapped out, released and kept (per reason), its warnings, the layers' class
names, whether a checkpointed layer ran under saved-tensor hooks (``save_on_cpu``'s), and whether
``remove()`` gave every ``OffloadWrapper`` (and the module inside) its own ``forward`` back.
"""

from __future__ import annotations

import os
import re
import warnings

import torch

STEPS = 3
LR = 0.1
BATCH, SEQ, VOCAB = 2, 8, 64
LAYERS, DIM = 3, 32
SETUP = "fsdp2"  # the one setup of dist_worker.run_setups: "plain", then "offload"


def _model():
    """A tiny Qwen2, the same weights on every rank (``use_cache=False``: a cache would grow in
    the checkpoint's recompute)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attn_implementation="eager", use_cache=False)
    return Qwen2ForCausalLM(config)


def _accelerator(offload: bool):
    """A fresh ``Accelerator`` whose ``prepare`` takes accelerate's FSDP2 path on CPU.

    On CPU accelerate ignores the FSDP plugin (it sets ``DistributedType.FSDP`` only for
    accelerator backends); setting the type and the plugin on its state makes ``prepare`` run
    ``fsdp2_prepare_model`` (``fsdp2_apply_ac``, ``fully_shard``) over gloo all the same. The
    state of an earlier run in this process is dropped first.
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType
    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=True, activation_checkpointing_offload=offload,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen2DecoderLayer"], reshard_after_forward=True)
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def _batch(rank: int, step: int) -> torch.Tensor:
    """This rank's token ids for ``step``, the same in both runs."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _offload_wrappers(layers) -> list:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper
    return [layer for layer in layers if isinstance(layer, OffloadWrapper)]


def _watch_saved_tensor_hooks(layers) -> tuple[list, list[bool]]:
    """Forward pre-hooks on each ``OffloadWrapper``'s checkpointed module: for every call, whether
    saved-tensor hooks were active (the wrapper's own ``forward`` enters ``save_on_cpu`` there)."""
    seen: list[bool] = []
    hooks = [layer._checkpoint_wrapped_module.register_forward_pre_hook(
        lambda mod, args: seen.append(
            torch._C._autograd._top_saved_tensors_default_hooks(False) is not None))
        for layer in _offload_wrappers(layers)]
    return hooks, seen


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard, detached and cloned (a plain tensor as is)."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def train(rank: int, offload: bool, swap: bool, params_path: str) -> dict:
    """``STEPS`` SGD steps of the model prepared by accelerate; with ``swap``,
    ``enable_swap_layer_input`` on the prepared model. The local shards go to ``params_path``."""
    import swap_pass
    swap_pass.reset()
    acc = _accelerator(offload)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    layers = list(model.model.layers)
    hooks, under_hooks = _watch_saved_tensor_hooks(layers)
    handle = swap_pass.enable_swap_layer_input(model) if swap else None
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            ids = _batch(rank, step)
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item().hex())
    stats = swap_pass.swap_stats()
    for hook in hooks:
        hook.remove()
    if handle is not None:
        handle.remove()
    torch.save({name: _local(p) for name, p in model.named_parameters()}, params_path)
    return {
        "losses": losses,
        "swapped_out_bytes": stats.swapped_out_bytes,
        "peak_device_bytes_released": stats.peak_device_bytes_released,
        "skipped_bytes": dict(stats.skipped_bytes),
        "layer_classes": [type(layer).__name__ for layer in layers],
        "under_saved_tensor_hooks": under_hooks,
        "own_forward_back": all("forward" not in vars(layer)
                                and "forward" not in vars(layer._checkpoint_wrapped_module)
                                for layer in _offload_wrappers(layers)),
        "swap_warnings": sorted({re.sub(r"@[0-9a-f]+", "", str(w.message).split(" (shape")[0])
                                 for w in caught if str(w.message).startswith("swap_pass")}),
    }


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point for ``torch.multiprocessing`` (``rank`` first): both runs through
    ``dist_worker.run_setups``, then ``out_dir/rank<r>.json`` with ``{SETUP: {"plain": ...,
    "offload": ...}}`` (or the traceback of the run that raised under ``"error"``)."""

    from tests.distributed import dist_worker
    # What accelerate's PartialState reads; one intra-op thread (it would pick its own count).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    dist_worker.init(rank, world, port)

    def run_one(setup: str, swap: bool) -> dict:
        name = "offload" if swap else "plain"
        return train(rank, offload=swap, swap=swap,
                     params_path=os.path.join(out_dir, f"rank{rank}-{name}.pt"))

    dist_worker.run_setups(rank, out_dir, [SETUP], run_one,
                           compare_runs=lambda plain, offload: {"plain": plain,
                                                                "offload": offload})
