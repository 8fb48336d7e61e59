"""TRL's activation-offloading scenarios on a real tiny Qwen2 (HF transformers, random weights),
written for swap_pass's ways in.

Each test compares a few steps bitwise with the same model without swap and shows that bytes
left the device, or, where nothing may move, the reason counted in ``swap_stats()``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import SmartSwap, SwapConfig
from swap_pass.smart import SmartSwapConfig
from swap_pass.tools.bench.hf_offload import hf_checkpointing_enable
from tests.peers.helpers import exact_steps, moved, qwen_batch, tiny_qwen2, twins

pytest.importorskip("transformers")

LAYER_INPUT = 2 * 8 * 32 * 4  # batch 2, sequence 8, hidden 32, fp32


def _loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _batches(n: int = 3, device: torch.device | str = "cpu"):
    return [tuple(t.to(device) for t in qwen_batch(i)) for i in range(n)]


def test_tiny_qwen2_same_as_without_swap(device):
    """TRL test_real_hf_model: a real Qwen2, every decoder layer's input swapped."""
    ref, model = twins(lambda: tiny_qwen2().to(device))
    handle = swap_pass.enable_swap_layer_input(model)
    assert handle.layers == list(model.model.layers)
    exact_steps(ref, model, _loss, _batches(device=device))
    assert moved() == 2 * LAYER_INPUT  # 3 layers: the last layer's input is never swapped
    handle.remove()


@pytest.mark.slow
def test_tiny_qwen2_smart_swap(device):
    """TRL test_real_hf_model, under SmartSwap."""
    ref, model = twins(lambda: tiny_qwen2().to(device))
    with SmartSwap(model, memory_budget=0.5, config=SmartSwapConfig(min_swap_bytes=0)) as smart:
        exact_steps(ref, model, _loss, _batches(4, device), smart=smart)
    assert swap_pass.swap_stats().swapped_out_bytes > 0


class LoraLinear(nn.Module):
    """A LoRA adapter with dropout on a frozen linear, written out (as PEFT's does it)."""

    def __init__(self, base: nn.Linear, r: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Linear(base.in_features, r, bias=False)
        self.b = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)  # nonzero: the adapter's path carries grads
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.b(self.a(self.drop(x))) * 2.0


def _lora_qwen2():
    """A tiny Qwen2 with LoRA (dropout 0.1) on q/v projections: PEFT's when installed."""
    model = tiny_qwen2()
    try:
        import peft
    except ImportError:
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj, attn.v_proj = LoraLinear(attn.q_proj), LoraLinear(attn.v_proj)
        return model
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                             target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def test_lora_with_dropout():
    """TRL test_offloading_with_peft_models: LoRA with dropout; the same seed, the same masks."""
    ref, model = twins(_lora_qwen2)
    handle = swap_pass.enable_swap_layer_input(model)
    model.train(), ref.train()
    with pytest.warns(RuntimeWarning, match="a forward kept 1 layer input"):  # see below
        exact_steps(ref, model, _loss, _batches())
    # The frozen embedding's output needs no grad: the first layer's input is user data (kept,
    # counted); the second layer's input carries the adapters' graph and leaves.
    assert moved() == LAYER_INPUT
    assert swap_pass.swap_stats().skipped_bytes["user_data"] == 3 * LAYER_INPUT
    handle.remove()


def test_min_offload_size_keeps_small_inputs_and_counts_them():
    """TRL test_min_offload_size: inputs under the threshold stay, counted as too_small."""
    ref, model = twins(tiny_qwen2)
    handle = swap_pass.enable_swap_layer_input(
        model, config=SwapConfig(min_swap_bytes=LAYER_INPUT + 1))
    exact_steps(ref, model, _loss, _batches())
    stats = swap_pass.swap_stats()
    assert moved() == 0 and stats.swapped_out_bytes == 0
    assert stats.skipped_bytes["too_small"] == 3 * 2 * LAYER_INPUT  # 3 steps, 2 layers
    handle.remove()


class TwiceSaved(nn.Module):
    """Saves one storage twice per op (``h * h``) and again in a second op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x) + 1
        return (h * h + h.exp()).mean()


def test_a_storage_saved_several_times_moves_once():
    """TRL test_tensor_deduplication: one storage saved by three references moves once."""
    ref, model = twins(TwiceSaved)
    batches = [(torch.randn(64, 32, generator=torch.Generator().manual_seed(i)),) for i in range(4)]
    with (pytest.warns(RuntimeWarning, match="memory_budget=0 B cannot be met"),
          SmartSwap(model, memory_budget=0, config=SmartSwapConfig(min_swap_bytes=0)) as smart):
        exact_steps(ref, model, lambda m, b: m(b[0]), batches, smart=smart)
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes > 0
    h_bytes = 64 * 32 * 4
    assert stats.swapped_out_bytes % h_bytes == 0
    assert stats.swapped_out_bytes <= 4 * 2 * h_bytes  # h and exp(h) at most, once each per step


@pytest.mark.slow
def test_gradient_accumulation():
    """TRL's gradient accumulation: two forwards, one backward each, grads summed; exact."""
    ref, model = twins(tiny_qwen2)
    handle = swap_pass.enable_swap_layer_input(model)
    b1, b2 = qwen_batch(0), qwen_batch(1)

    def accumulate(m, _batch):
        return _loss(m, b1) + _loss(m, b2)  # both forwards before one backward

    exact_steps(ref, model, accumulate, [b1, b2])
    assert moved() == 2 * 2 * LAYER_INPUT
    handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_gradient_checkpointing(use_reentrant):
    """TRL with HF activation checkpointing (``gradient_checkpointing_enable`` before
    transformers 5)."""
    ref, model = twins(tiny_qwen2)
    for m in (ref, model):
        hf_checkpointing_enable(m, use_reentrant=use_reentrant)
        m.train()
    handle = swap_pass.enable_swap_layer_input(model)
    exact_steps(ref, model, _loss, _batches())
    assert moved() == 2 * LAYER_INPUT
    handle.remove()
