"""One rank of the torchtitan distributed test: ``parallelize_llama`` on 2 gloo ranks (CPU).

torchtitan's llama3 debug model (4 layers, SDPA attention) parallelized by torchtitan's own
``parallelize_llama`` with FSDP (``dp_shard=2``) or tensor + sequence parallel (``tp=2``; DTensor
activations between blocks), tensor parallel also with
torchtitan's full activation checkpointing;
three optimizer steps without and with ``enable_swap_layer_input``, compared by
``tests.distributed.dist_worker``; ``COMPILE_SETUPS``: each block's forward compiled by
``swap_pass.compile_layers`` (aot_eager), without and with swap; ``"module-compile"``: the
refusal of swap on blocks torchtitan's own compile compiled; ``FULL_AC_COMPILE``: the error of
``compile_layers`` on the full-AC blocks, without and with swap. :func:`run_smart`: the same
model, ``dp_shard=2``, ``tp=2`` and ``tp=2`` with full AC, without and with ``SmartSwap``, by
``tests.smart.dist_worker``.
"""

from __future__ import annotations

import torch

SETUPS = ["fsdp", "tp", "tp-full-ac"]
# Swap switched on by torchtitan's own converter path: model_registry(..., converters=[
# SwapLayerInputConverter.Config()]), the model built as torchtitan's Trainer builds it (meta
# device, parallelize_fn, to_empty, init_weights); the reference: the same without the converter.
# FSDP with torchtitan's selective AC (its debug model's default), TP + SP with its full AC.
CONVERTER_SETUPS = ["fsdp-sac-converter", "tp-full-ac-converter"]
# Each block's forward compiled with swap_pass.compile_layers(model, backend="aot_eager") after
# parallelize_llama (torchtitan's own compile off), against the same compile without swap.
# "tp-full-ac-compile-wrapped": under FullAC, the modules inside torch's checkpoint_wrapper
# compiled (layers=...), the checkpoint eager around them.
COMPILE_SETUPS = ["fsdp-compile-layers", "tp-compile-layers", "tp-full-ac-compile-wrapped"]
# compile_layers(model) under FullAC compiles each checkpoint_wrapper's forward: Dynamo traces the
# checkpoint over the DTensor block, and torch fails in the first forward, without swap too.
FULL_AC_COMPILE = "tp-full-ac-compile-layers"
SMART_SETUPS = ["fsdp", "tp"]
# SmartSwap on tp=2 with FullAC, at the same budget: out of reach (see the test).
SMART_FULL_AC = "tp-full-ac"
# SmartSwap's memory_budget here. At 0.5 the tp=2 plan is infeasible: at the end of the forward
# (the loss) more than half the profiled saved peak is held by the forward itself.
SMART_BUDGET = 0.75
LAYERS = 4


def build(setup: str, world: int = 2, compile_config=None) -> torch.nn.Module:
    """The debug model built from torchtitan's config, parallelized as ``setup`` says, with
    ``compile_config`` (default: torchtitan's, compile off)."""
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
    ac = FullAC.Config() if "full-ac" in setup else None
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                      parallelism=parallelism, compile_config=compile_config or CompileConfig(),
                      ac_config=ac,
                      dump_folder="/tmp")
    for module in model.modules():  # gloo has no PREMUL_SUM: reduce with SUM and divide apart
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _parallelism(setup: str, world: int) -> tuple:
    """torchtitan's ``ParallelismConfig`` and built ``ParallelDims`` for ``setup``."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    tp = 2 if setup.startswith("tp") else 1
    parallelism = ParallelismConfig(data_parallel_shard_degree=world // tp,
                                    tensor_parallel_degree=tp, spmd_backend="partial_dtensor")
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return parallelism, dims


def build_as_trainer(setup: str, swap: bool, world: int = 2) -> torch.nn.Module:
    """The debug model as torchtitan's ``Trainer.__init__`` builds it (no pipeline parallel):
    the model spec from ``model_registry`` (``converters=[SwapLayerInputConverter.Config()]``
    when ``swap``), its config built on the meta device, ``spec.parallelize_fn``, ``to_empty``
    on the CPU, ``init_weights``, ``train()``. The Trainer itself is not run: its data, metrics
    and checkpoint components need packages this CPU test does not install, and it assumes an
    accelerator."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from swap_pass.integrations.torchtitan import SwapLayerInputConverter

    parallelism, dims = _parallelism(setup, world)
    spec = model_registry("debugmodel", attn_backend="flex",
                          converters=[SwapLayerInputConverter.Config()] if swap else None)
    config = spec.model
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:  # FlexAttention has no CPU backward: torchtitan's SDPA module
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # what Trainer.__init__'s model_config.update_from_config does for llama3 (that method
    # imports the Trainer)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    ac = FullAC.Config() if "full-ac" in setup else SelectiveAC.Config()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(),
                                parallelism=parallelism, compile_config=CompileConfig(),
                                ac_config=ac, dump_folder="/tmp")
    for module in model.modules():  # gloo has no PREMUL_SUM: reduce with SUM and divide apart
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def _train(setup: str, rank: int, swap: bool) -> dict:
    import swap_pass
    from tests.distributed import dist_worker, models
    from tests.integrations import torchtitan_cpu as tc
    swap_pass.reset()
    if setup in CONVERTER_SETUPS:
        return _train_converted(setup, rank, swap)
    model = build(setup)
    compiled = setup in COMPILE_SETUPS
    if compiled:  # each block's forward compiled; the reference: the same compile, no swap
        from torch import _dynamo
        _dynamo.reset()
        _dynamo.utils.counters.clear()  # graphs and breaks of this compile alone
        layers = None  # compile_layers finds the blocks
        if setup.endswith("wrapped"):  # the modules inside torch's checkpoint_wrapper
            layers = [block._checkpoint_wrapped_module for block in model.layers.values()]
        handle = swap_pass.compile_layers(model, backend="aot_eager", swap=swap,
                                          layers=layers).swap
    else:
        handle = swap_pass.enable_swap_layer_input(model) if swap else None
    seeds = [step if setup.startswith("tp") else 100 * step + rank
             for step in range(dist_worker.STEPS)]
    rec = dist_worker.train_steps(model, model, handle, [tc.make_batch(seed=s) for s in seeds],
                                  models.loss_of)
    if compiled:
        rec["compiled"] = dist_worker._graphs(None)
    return rec


def _train_converted(setup: str, rank: int, swap: bool) -> dict:
    """``setup`` of :data:`CONVERTER_SETUPS`: swap armed by the converter, enabled by the first
    forward on the blocks as parallelized (checked here: an error is reported)."""
    from swap_pass.integrations.torchtitan import deferred_swap
    from tests.distributed import dist_worker, models
    from tests.integrations import torchtitan_cpu as tc

    model = build_as_trainer(setup, swap)
    deferred = deferred_swap(model) if swap else None
    if deferred is not None:
        assert deferred.handle is None, "swap was enabled before the first forward"
        model.register_forward_hook(lambda mod, args, out: _check_enabled(mod, deferred))
    seeds = [step if setup.startswith("tp") else 100 * step + rank
             for step in range(dist_worker.STEPS)]
    return dist_worker.train_steps(model, model, deferred,
                                   [tc.make_batch(seed=s) for s in seeds], models.loss_of)


def _check_enabled(model: torch.nn.Module, deferred) -> None:
    blocks = list(model.layers.values())
    assert deferred.handle is not None and deferred.layers == blocks, (deferred, blocks)


def module_compile_refused() -> str:
    """The error of ``enable_swap_layer_input`` on ``dp_shard=2`` built with torchtitan's own
    per-block compile (``CompileConfig(enable=True, backend="aot_eager")``: every block's
    ``nn.Module.compile``); Dynamo's global knobs that torchtitan sets are restored after."""
    import torch._dynamo
    from torchtitan.config import CompileConfig

    import swap_pass
    saved = torch._dynamo.config.save_config()
    try:
        model = build("fsdp", compile_config=CompileConfig(enable=True, backend="aot_eager"))
        try:
            swap_pass.enable_swap_layer_input(model)
        except RuntimeError as err:
            return str(err)
        return ""
    finally:
        torch._dynamo.config.load_config(saved)
        torch._dynamo.reset()


def full_ac_compile_error(swap: bool) -> str:
    """``"<type>: <message>"`` of the error of the first forward of ``tp-full-ac`` with every block
    compiled by ``compile_layers(model, backend="aot_eager", swap=swap)``; ``""`` when it runs."""
    from torch import _dynamo

    import swap_pass
    from tests.integrations import torchtitan_cpu as tc
    swap_pass.reset()
    _dynamo.reset()
    model = build(SMART_FULL_AC)
    handle = swap_pass.compile_layers(model, backend="aot_eager", swap=swap)
    try:
        model(tc.make_batch()[0])
    except Exception as err:  # noqa: BLE001  (reported)
        return f"{type(err).__name__}: {err}"
    finally:
        handle.remove()
        swap_pass.reset()
    return ""


def run(rank: int, world: int, port: int, out_dir: str, setups: list[str]) -> None:
    """Entry point for ``torch.multiprocessing`` (``rank`` first); ``"module-compile"`` in
    ``setups`` reports :func:`module_compile_refused` under ``"module-compile"``,
    ``FULL_AC_COMPILE`` :func:`full_ac_compile_error` without (``"torch"``) and with
    (``"swap_pass"``) swap."""
    from tests.distributed import dist_worker
    _cpu_torchtitan()
    dist_worker.init(rank, world, port)
    report = {}
    if "module-compile" in setups:
        report["module-compile"] = {"refused": module_compile_refused()}
    if FULL_AC_COMPILE in setups:
        report[FULL_AC_COMPILE] = {"torch": full_ac_compile_error(False),
                                   "swap_pass": full_ac_compile_error(True)}
    dist_worker.run_setups(rank, out_dir,
                           [s for s in setups if s not in ("module-compile", FULL_AC_COMPILE)],
                           lambda setup, swap: _train(setup, rank, swap), report=report)


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
