"""Run torchtitan's llama3 debug model on a CPU-only machine: import shim and model builder.

Test support, not library code:

* ``torchtitan.distributed.minimal_async_ep.kernels`` imports triton (GPU kernels for expert
  parallel all-to-all) when torchtitan's package imports: a stand-in module takes its place,
  whose functions raise if ever called (the dense llama3 model never calls them);
* the llama3 configs use FlexAttention (no CPU backward) or varlen (no CPU kernel): each block's
  ``attention.inner_attention`` is replaced by torchtitan's own ``ScaledDotProductAttention``.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

SEQ, BATCH = 32, 2
_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


class _NoTriton(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{_KERNELS}.{name} needs triton, which this CPU test lacks")
        return unavailable


def import_shim() -> None:
    """Let torchtitan import without triton (idempotent)."""
    if importlib.util.find_spec("triton") is None and _KERNELS not in sys.modules:
        sys.modules[_KERNELS] = _NoTriton(_KERNELS)


def make_llama3_debug(seed: int = 0, n_layers: int | None = None,
                      converters: list | None = None) -> torch.nn.Module:
    """torchtitan's llama3 ``debugmodel`` (dim 256), SDPA attention, weights from ``seed``; its
    configuration from torchtitan's ``model_registry``, which applies ``converters`` (a list of
    ``ModelConfigConverter.Config``) as its config functions do."""
    import_shim()
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex", converters=converters).model
    if n_layers is not None:
        config.layers = config.layers[:n_layers]
    torch.manual_seed(seed)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    for block in model.layers.values():
        block.attention.inner_attention = ScaledDotProductAttention(
            ScaledDotProductAttention.Config())
    return model


def apply_ac(model: torch.nn.Module, mode: str) -> None:
    """torchtitan's activation checkpointing on every block: ``"none"``, ``"full"``,
    ``"selective"``."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if mode == "full":
        FullAC(FullAC.Config()).apply(model)
    elif mode == "selective":
        SelectiveAC(SelectiveAC.Config()).apply(model)


def make_batch(vocab: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, cross-entropy and backward; the loss and every parameter's grad."""
    tokens, labels = batch
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
