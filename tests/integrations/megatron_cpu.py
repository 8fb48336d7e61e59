"""Run megatron-core on a CPU-only machine: device shims, a tiny GPT, and one training step.

Test support, not library code. megatron-core assumes CUDA in a few places that matter for a
single forward/backward; each shim below points one of them at the CPU:

* the RNG tracker (``tensor_parallel.random``) reads and writes the CUDA generator: it gets the
  CPU generator instead, so dropout under full recompute replays exactly;
* ``torch.cuda.current_device()`` places scratch buffers (attention, RoPE, p2p shapes);
* the pipeline schedules count tokens in a ``device="cuda"`` tensor and p2p calls
  ``torch.cuda.synchronize()``;
* sequence parallel needs a layer norm that tags its parameters ``sequence_parallel`` (apex's
  ``FusedLayerNorm`` or Transformer Engine's; the local spec's ``WrappedTorchNorm`` refuses
  sequence parallel): :class:`SequenceParallelNorm` is that norm on the CPU.

Everything else is Megatron's real code: the local (non-Transformer-Engine) layer spec, its
``CheckpointFunction`` for full recompute, its selective recompute, its 1F1B and interleaved
schedules over gloo.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from unittest import mock

import torch

VOCAB, SEQ, HIDDEN, HEADS, FFN = 128, 16, 64, 4, 128


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _torch_without_cuda_zeros(real_torch: types.ModuleType) -> types.SimpleNamespace:
    """The schedules module's ``torch``, with ``zeros(device="cuda")`` made on the CPU."""

    class _Torch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real_torch, name)

    proxy = _Torch("torch")

    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")) == "cuda":
            kwargs["device"] = "cpu"
        return real_torch.zeros(*args, **kwargs)

    proxy.zeros = zeros
    return proxy


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Patch megatron-core's CUDA-only calls to the CPU for the duration of the block."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mrandom

    with contextlib.ExitStack() as stack:
        patches = [
            mock.patch.object(mrandom, "_get_cuda_rng_state",
                              lambda *a, **k: torch.get_rng_state()),
            mock.patch.object(mrandom, "_set_cuda_rng_state",
                              lambda state, *a, **k: torch.set_rng_state(state)),
            mock.patch.object(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
            mock.patch.object(torch.cuda, "manual_seed", torch.manual_seed),
            mock.patch.object(torch.cuda, "current_device", _cpu_device),
            mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None),
            mock.patch.object(schedules, "torch", _torch_without_cuda_zeros(torch)),
        ]
        if hasattr(p2p_communication, "torch"):
            patches.append(mock.patch.object(p2p_communication.torch.cuda, "synchronize",
                                             lambda *a, **k: None))
        for patch in patches:
            stack.enter_context(patch)
        yield


def init_parallel(pp: int = 1, vp: int | None = None, tp: int = 1) -> None:
    """One gloo process group (single rank unless torchrun started more) and Megatron's groups:
    ``tp``-way tensor parallel, ``pp`` pipeline stages, ``vp`` virtual stages per rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        import os
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("gloo")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(num_layers: int = 4, recompute: str = "none", method: str | None = None,
                recompute_layers: int = 1, pp: int = 1, vp: int | None = None, **extra):
    """A tiny ``TransformerConfig`` for the CPU: fusions off, dropout on.

    Args:
        recompute: ``"none"``, ``"full"`` or ``"selective"`` (Megatron's granularity).
        method: ``"uniform"`` or ``"block"`` for full recompute.
        recompute_layers: Megatron's ``recompute_num_layers``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
              ffn_hidden_size=FFN, hidden_dropout=0.1, attention_dropout=0.1,
              use_cpu_initialization=True, params_dtype=torch.float32,
              bias_activation_fusion=False, bias_dropout_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False,
              apply_rope_fusion=False, pipeline_model_parallel_size=pp,
              virtual_pipeline_model_parallel_size=vp, pipeline_dtype=torch.float32)
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method=method,
                  recompute_num_layers=recompute_layers)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    kw.update(extra)
    return TransformerConfig(**kw)


class SequenceParallelNorm(torch.nn.LayerNorm):
    """A layer norm with the constructor of Megatron's ``FusedLayerNorm``, in plain torch.

    Under sequence parallel each rank normalizes its own sequence shard, so the weight and bias
    gradients are partial sums: like ``FusedLayerNorm``, the parameters carry
    ``sequence_parallel=True`` and Megatron's ``finalize_model_grads`` (or
    :func:`allreduce_sequence_parallel_grads`) sums them over the tensor-parallel group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)


def sequence_parallel_spec(config):
    """The local GPT layer spec for every layer, with :class:`SequenceParallelNorm` as its two
    norms and the block's final norm (a ``TransformerBlockSubmodules`` for ``GPTModel``)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec()
    submodules = dataclasses.replace(layer.submodules, input_layernorm=SequenceParallelNorm,
                                     pre_mlp_layernorm=SequenceParallelNorm)
    per_stage = config.num_layers // (config.pipeline_model_parallel_size
                                      * (config.virtual_pipeline_model_parallel_size or 1))
    return TransformerBlockSubmodules(  # the layers of one (virtual) pipeline stage
        layer_specs=[dataclasses.replace(layer, submodules=submodules)] * per_stage,
        layer_norm=SequenceParallelNorm)


def allreduce_sequence_parallel_grads(model) -> None:
    """Sum the ``sequence_parallel`` parameters' gradients over the tensor-parallel group with
    Megatron's own step of ``finalize_model_grads`` (which reads the chunk's ``ddp_config``)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    if not hasattr(model, "ddp_config"):
        model.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([model], model.config)


def make_gpt(config, seed: int = 1234, pre_process: bool = True, post_process: bool = True,
             vp_stage: int | None = None, spec=None):
    """A GPTModel with the local layer spec (or ``spec``), same weights for the same seed."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    kw = {} if vp_stage is None else {"vp_stage": vp_stage}
    spec = get_gpt_layer_local_spec() if spec is None else spec
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre_process,
                    post_process=post_process, position_embedding_type="rope", **kw)


def make_batch(batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, positions and labels for one micro-batch ([batch, seq])."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).expand(batch, SEQ).contiguous(),
            # Megatron's default causal mask is built on "cuda": pass it (True = masked out).
            "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)}


def tensor_parallel_seed(seed: int) -> None:
    """Seed Megatron's RNG tracker (dropout inside the layers) the way training does."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def train_step(model, batch: dict[str, torch.Tensor], seed: int = 7) -> tuple[torch.Tensor, dict]:
    """Forward and backward of one micro-batch; returns the loss and every parameter's grad."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    tensor_parallel_seed(seed)
    loss = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                 labels=batch["labels"]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
