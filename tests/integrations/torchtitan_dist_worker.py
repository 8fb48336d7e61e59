"""One rank of the torchtitan distributed test: ``parallelize_llama`` on 2 gloo ranks (CPU).

torchtitan's llama3 debug model (4 layers, SDPA attention) parallelized by torchtitan's own
``parallelize_llama`` with FSDP (``dp_shard=2``) or tensor + sequence parallel (``tp=2``; DTensor
activations between blocks), tensor parallel also with
torchtitan's full activation checkpointing;
three optimizer steps without and with ``enable_swap_layer_input``, compared by
``tests.distributed.dist_worker``. :func:`run_smart`: the same model, ``dp_shard=2`` and
``tp=2``, without and with ``SmartSwap``, by ``tests.smart.dist_worker``.
"""

from __future__ import annotations

import torch

SETUPS = ["fsdp", "tp", "tp-full-ac"]
SMART_SETUPS = ["fsdp", "tp"]
# SmartSwap's memory_budget here. At 0.5 the tp=2 plan is infeasible: at the end of the forward
# (the loss) more than half the profiled saved peak is held by the forward itself.
SMART_BUDGET = 0.75
LAYERS = 4


def build(setup: str, world: int = 2) -> torch.nn.Module:
    """The debug model built from torchtitan's config, parallelized as ``setup`` says."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    tp = 2 if setup.startswith("tp") else 1
    parallelism = ParallelismConfig(data_parallel_shard_degree=world // tp,
                                    tensor_parallel_degree=tp, spmd_backend="partial_dtensor")
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:  # FlexAttention has no CPU backward: torchtitan's SDPA module
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    ac = FullAC.Config() if setup.endswith("full-ac") else None
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                      parallelism=parallelism, compile_config=CompileConfig(), ac_config=ac,
                      dump_folder="/tmp")
    for module in model.modules():  # gloo has no PREMUL_SUM: reduce with SUM and divide apart
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _train(setup: str, rank: int, swap: bool) -> dict:
    import swap_pass
    from tests.distributed import dist_worker, models
    from tests.integrations import torchtitan_cpu as tc
    swap_pass.reset()
    model = build(setup)
    handle = swap_pass.enable_swap_layer_input(model) if swap else None
    seeds = [step if setup.startswith("tp") else 100 * step + rank
             for step in range(dist_worker.STEPS)]
    return dist_worker.train_steps(model, model, handle, [tc.make_batch(seed=s) for s in seeds],
                                   models.loss_of)


def run(rank: int, world: int, port: int, out_dir: str, setups: list[str]) -> None:
    """Entry point for ``torch.multiprocessing`` (``rank`` first)."""
    from tests.distributed import dist_worker
    _cpu_torchtitan()
    dist_worker.init(rank, world, port)
    dist_worker.run_setups(rank, out_dir, setups, lambda setup, swap: _train(setup, rank, swap))


def _cpu_torchtitan() -> None:
    """torchtitan importable without triton, its meshes on CPU (once per rank)."""
    from tests.integrations import torchtitan_cpu as tc
    tc.import_shim()
    from torchtitan.distributed import parallel_dims
    parallel_dims.device_type = "cpu"  # torchtitan's default is the accelerator's


def smart_setup(setup: str, rank: int, mesh) -> tuple:
    """``tests.smart.dist_worker``'s ``(model, batch, loss)`` for ``setup`` (``mesh`` unused:
    ``parallelize_llama`` builds its own)."""
    from tests.distributed import models
    from tests.integrations import torchtitan_cpu as tc
    _cpu_torchtitan()
    same_data = setup.startswith("tp")  # TP ranks share the batch
    return build(setup), lambda step: tc.make_batch(
        seed=step if same_data else 100 * step + rank), models.loss_of


def run_smart(rank: int, world: int, port: int, out_dir: str, setups: list[str]) -> None:
    """Entry point for ``torch.multiprocessing``: ``setups`` without and with ``SmartSwap``."""
    from tests.smart import dist_worker
    _cpu_torchtitan()
    dist_worker.run(rank, world, port, out_dir, setups, smart_setup, SMART_BUDGET)
