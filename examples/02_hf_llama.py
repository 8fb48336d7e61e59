"""``enable_swap_layer_input`` on a Hugging Face Llama: no source edits.

A tiny ``LlamaForCausalLM`` with random weights (nothing is downloaded), activation checkpointing
on. ``enable_swap_layer_input(model)`` finds ``model.model.layers`` itself (an ``nn.ModuleList``
of same-class blocks) and returns a handle; ``handle.remove()`` restores the model exactly. A
model set up with ``activation_checkpointing_enable(offload=True)`` (HF's synchronous
``save_on_cpu``) gets swap_pass's asynchronous swap in its place::

    python examples/02_hf_llama.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import swap_pass


def tiny_llama(offload: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(offload=offload)
    else:  # older releases: the name it had before
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def train(model: LlamaForCausalLM, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> int:
    swap_pass.reset()
    plain, swapped = tiny_llama(), tiny_llama(offload=True)
    expected = train(plain)
    handle = swap_pass.enable_swap_layer_input(swapped)  # takes over HF's offload
    got = train(swapped)
    handle.remove()
    stats = swap_pass.swap_stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (expected, got)
    assert stats.swap_outs > 0 and stats.host_bytes_in_use == 0, stats
    print(f"losses: {[round(float(x), 4) for x in got]}; swap-outs: {stats.swap_outs}")
    print("OK: HF Llama losses bitwise equal with and without swap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
