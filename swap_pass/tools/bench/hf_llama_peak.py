"""Whole-step peak of HF Llama under ``torch.compile``, for ``scripts/graph_peak.py`` and the tests.

Needs ``transformers`` (imported when called). The model: ``LlamaForCausalLM`` with random
weights, 4 attention heads, MLP 4x hidden; the labels are the inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swap_pass.tools.bench.hf_offload import hf_checkpointing_enable
from swap_pass.tools.bench.measure import warm_step_peak

__all__ = ["hf_llama_step_peak"]


def _hf_llama(layers: int, hidden: int, seq: int, vocab: int, checkpoint: bool,
              device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=seq, use_cache=False)
    model = LlamaForCausalLM(cfg).to(device)
    if checkpoint:
        hf_checkpointing_enable(model)
    return model.train()


def hf_llama_step_peak(backend: str | Callable, *, checkpoint: bool, layers: int = 4,
                       hidden: int = 64, batch: int = 8, seq: int = 512, vocab: int = 128,
                       device: torch.device | str = "cpu") -> tuple[int, list[torch.Tensor]]:
    """Peak bytes of one profiled training step after a warm-up step, and the step's gradients.

    Args:
        backend: The ``torch.compile`` backend (``fullgraph=True``).
        checkpoint: HF gradient checkpointing (non-reentrant) on every layer.
        layers, hidden, batch, seq, vocab: The model and batch. Defaults: 4 layers, hidden 64,
            batch 8, sequence 512 (one layer input is 1 MiB in fp32), vocabulary 128.
        device: Where the model runs. Default: ``"cpu"``.
    """
    import swap_pass

    device = torch.device(device)
    model = _hf_llama(layers, hidden, seq, vocab, checkpoint, device)
    ids = torch.randint(0, vocab, (batch, seq),
                        generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    swap_pass.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    peak = warm_step_peak(device, lambda: compiled(input_ids=ids, labels=ids).loss.backward(),
                          lambda: model.zero_grad(set_to_none=True))
    return peak, [p.grad.clone() for p in model.parameters()]
