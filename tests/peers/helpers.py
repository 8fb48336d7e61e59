"""Shared pieces of the peers' scenarios: small blocks, a tiny Qwen2, and exact stepping.

Every scenario trains a model with swap and its deep copy without swap for a few steps and
compares the loss and every gradient with ``torch.equal``; the batches the caller passes are
checked unchanged after each step.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn

import swap_pass

HIDDEN = 32


class LinearBlock(nn.Module):
    """Linear, ReLU, Linear, with a residual: the blocks of torchtune's offloading tests."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class BlockStack(nn.Module):
    """A projection of the input, then ``n`` blocks in an ``nn.ModuleList``."""

    def __init__(self, n: int = 4, block=LinearBlock, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return h.square().mean()


def tiny_qwen2(seed: int = 0, layers: int = 3):
    """A Qwen2 causal LM from HF transformers, built locally with random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="eager")
    return Qwen2ForCausalLM(cfg)


def qwen_batch(seed: int, b: int = 2, s: int = 8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (b, s), generator=g)
    return ids, ids.clone()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(ref_out, out) -> None:
    (ref_loss, ref_grads), (loss, got) = ref_out, out
    assert torch.equal(ref_loss, loss), (ref_loss.item(), loss.item())
    assert ref_grads.keys() == got.keys() and ref_grads
    for name in ref_grads:
        assert torch.equal(ref_grads[name], got[name]), name


def one_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], *,
             seed: int | None = None, during: Callable[[], None] | None = None):
    """Loss and gradients of one step; ``seed`` seeds dropout the same way for both twins."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = loss_fn(model)
    if during is not None:
        during()
    loss.backward()
    return loss.detach(), grads(model)


def exact_steps(ref: nn.Module, model: nn.Module, loss_of: Callable, batches: list,
                *, smart=None, during: Callable[[], None] | None = None) -> None:
    """Train ``model`` (with swap) and ``ref`` (without) on ``batches``; bitwise equal each step.

    ``loss_of(model, batch) -> loss``. The batches' tensors must hold their values after every
    step. ``smart``: a SmartSwap to step after each step (the reference runs outside its hooks).
    """
    for i, batch in enumerate(batches):
        before = [t.clone() for t in batch]
        with _no_saved_hooks() if smart is not None else contextlib.nullcontext():
            ref_out = one_step(ref, lambda m, batch=batch: loss_of(m, batch), seed=i)
        out = one_step(model, lambda m, batch=batch: loss_of(m, batch), seed=i, during=during)
        assert_same_step(ref_out, out)
        assert all(torch.equal(t, b) for t, b in zip(batch, before, strict=True))
        if smart is not None:
            smart.step()


def _no_saved_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def twins(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    ref = factory()
    return ref, copy.deepcopy(ref)


def moved() -> int:
    """Device bytes a swap freed at its peak (0 when nothing left the device)."""
    return swap_pass.swap_stats().peak_device_bytes_released
