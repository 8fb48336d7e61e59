"""Test helpers for SmartSwap: the independent resident-bytes counter and small model helpers."""

from __future__ import annotations

import torch

from swap_pass.models import LlamaConfig, LlamaStyleModel
from swap_pass.smart.bench import ResidentSavedBytes

# Reads storage sizes through weak references; never SmartSwap's bookkeeping (see its docstring).
SavedBytesCounter = ResidentSavedBytes


def tiny_model(seed: int = 0, **cfg) -> LlamaStyleModel:
    torch.manual_seed(seed)
    return LlamaStyleModel(LlamaConfig(**cfg))


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]
