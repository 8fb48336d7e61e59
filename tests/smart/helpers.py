"""Test helpers for SmartSwap: an independent counter of resident saved bytes, and runs to compare."""

from __future__ import annotations

import copy
import torch

from swap_pass.models import LlamaConfig, LlamaStyleModel, make_batch
from swap_pass.smart.bench import ResidentSavedBytes


class SavedBytesCounter(ResidentSavedBytes):
    """The bench's independent counter (storage sizes, weak references) with its samples kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.samples: list[int] = []

    def sample(self) -> int:
        value = super().sample()
        self.samples.append(value)
        return value


def tiny_model(seed: int = 0, **cfg) -> LlamaStyleModel:
    torch.manual_seed(seed)
    return LlamaStyleModel(LlamaConfig(**cfg))


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def baseline_step(model, batch, seq, seed=0):
    """Loss, grads and counted saved-bytes peak of one step without swap (on a deep copy)."""
    ref = copy.deepcopy(model)
    ids, labels = make_batch(ref.cfg, batch, seq, seed=seed)
    with SavedBytesCounter(ref) as counter:
        loss = ref(ids, labels)
        counter.sample()
        loss.backward()
    return loss.detach(), grads_of(ref), counter.peak


def assert_grads_equal(model, expected) -> None:
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)
