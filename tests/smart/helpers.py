"""Test helpers for SmartSwap: the independent resident-bytes counter and small model helpers."""

from __future__ import annotations

import copy

import torch

from swap_pass import SmartSwap
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch
from swap_pass.tools.smart_bench import ResidentSavedBytes

# Reads storage sizes through weak references; never SmartSwap's bookkeeping (see its docstring).
SavedBytesCounter = ResidentSavedBytes


def tiny_model(seed: int = 0, **cfg) -> LlamaStyleModel:
    torch.manual_seed(seed)
    return LlamaStyleModel(LlamaConfig(**cfg))


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


BATCH, SEQ = 2, 32


def no_hooks():
    """Run the reference model with no saved-tensor hooks, even inside SmartSwap's context."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


class Pair:
    """A model under SmartSwap and its unswapped twin, stepped together and compared exactly."""

    def __init__(self, device="cpu", recompute=False, **cfg) -> None:
        self.model = tiny_model(**cfg).to(device)
        self.model.recompute = recompute
        self.ref = copy.deepcopy(self.model)
        self.device = device

    def step(self, smart: SmartSwap, seq: int = SEQ, batch: int = BATCH,
             seed: int = 0, between=None) -> SavedBytesCounter:
        """One step of both models, compared bitwise; ``between()`` runs after the swapped
        model's forward, before its backward."""
        ids, labels = make_batch(self.model.cfg, batch, seq, seed=seed, device=self.device)
        with no_hooks():
            ref_loss = self.ref(ids, labels)
            ref_loss.backward()
        with SavedBytesCounter(self.model) as counter:
            loss = self.model(ids, labels)
            counter.sample()
            if between is not None:
                between()
            loss.backward()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(self.model.parameters(), self.ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        self.model.zero_grad(set_to_none=True)
        self.ref.zero_grad(set_to_none=True)
        smart.step()
        return counter


def unswapped_peak(pair: Pair, seq: int = SEQ, batch: int = BATCH) -> int:
    model = copy.deepcopy(pair.model)
    ids, labels = make_batch(model.cfg, batch, seq, device=pair.device)
    with SavedBytesCounter(model) as counter:
        model(ids, labels).backward()
    return counter.peak
