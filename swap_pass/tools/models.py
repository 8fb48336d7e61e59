"""A small Llama-style decoder used by the demo, the benchmarks, the examples and the tests.

Layers take and return ``hidden_states`` (the residual stream), as in HF transformers and
Megatron, so every way into swap_pass can act on it. Random weights, no downloads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LlamaConfig", "LlamaDecoderLayer", "LlamaStyleModel", "TraceableLlama", "make_batch"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of :class:`LlamaStyleModel`.

    Args:
        vocab_size: Default: ``256``.
        hidden_size: Default: ``64``.
        num_layers: Default: ``4``.
        num_heads: Default: ``4``.
        intermediate_size: MLP width. Default: ``176``.
        max_seq_len: Longest sequence the rotary table covers. Default: ``4096``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 176
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"swap_pass.tools.models.LlamaConfig: hidden_size={self.hidden_size} is not "
                f"divisible by num_heads={self.num_heads}. It must be."
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block:
    ``forward(hidden_states, cos, sin) -> hidden_states``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        h = hidden_states + self.attn(self.input_norm(hidden_states), cos, sin)
        return h + self.mlp(self.post_norm(h))


class LlamaStyleModel(nn.Module):
    """Embedding, ``num_layers`` decoder layers in ``self.layers``, norm, LM head; returns the loss.

    Args:
        cfg: Sizes. Default: ``LlamaConfig()``.
        recompute: Wrap each layer in non-reentrant activation checkpointing, so that a layer
            keeps only its input for backward (full recompute). Default: ``False``.
    """

    def __init__(self, cfg: LlamaConfig | None = None, *, recompute: bool = False) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.recompute = recompute
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[1]  # narrow, not [:seq]: torch.fx.symbolic_trace traces it
        cos = self.cos_table.narrow(0, 0, seq).to(self.embed.weight.dtype)
        sin = self.sin_table.narrow(0, 0, seq).to(self.embed.weight.dtype)
        h = self.embed(input_ids)
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        logits = self.lm_head(self.norm(h)).float()
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


class TraceableLlama(nn.Module):
    """``LlamaStyleModel`` with the rotary tables as inputs, so ``torch.fx.symbolic_trace`` can
    trace it: ``forward(input_ids, cos, sin, labels) -> loss``, the layers run without
    checkpointing."""

    def __init__(self, model: LlamaStyleModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embed(input_ids)
        for layer in m.layers:
            h = layer(h, cos, sin)
        logits = m.lm_head(m.norm(h)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def make_batch(cfg: LlamaConfig, batch: int, seq: int, *, seed: int = 0,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token labels, reproducible from ``seed``; both contiguous.

    Contiguous like a data loader's batches: ``torch.distributed.pipelining`` in torch 2.11
    checks micro-batch strides against its shape inference and refuses the (seq + 1)-strided
    slices of one token tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
