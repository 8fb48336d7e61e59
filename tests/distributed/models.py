"""A tiny Llama-style model named like torchtitan's (``tok_embeddings``, ``layers``,
``attention.wq``, ``feed_forward.w1``, ...), so that torch's tensor-parallel plans apply to it as
they do to torchtitan's; and the plans, data and exact comparisons the distributed workers share.

Test support, not library code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, FFN, LAYERS, BATCH, SEQ = 64, 32, 4, 64, 4, 2, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # -1 heads: a column-parallel projection holds a share of them
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyTitan(nn.Module):
    """Embedding, ``LAYERS`` blocks in ``layers``, norm, output; returns logits."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def apply_tp(model: TinyTitan, mesh, style: str) -> None:
    """``"sp"``: torchtitan's plan, sequence parallel, DTensor activations between blocks
    (``use_local_output=False`` on the projections back to the residual stream); ``"classic"``:
    Megatron-style TP without SP, the default ``use_local_output`` everywhere (the embedding's
    all-reduce result reaches the first block as an ``AsyncCollectiveTensor``); ``"sp-local"``:
    sequence parallel with the default ``use_local_output`` (torchtitan up to 0.2): plain local
    shards between blocks, which each ``SequenceParallel`` norm wraps with
    ``DTensor.from_local``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    def outer(plan: dict) -> dict:  # a pipeline stage holds only some of the outer modules
        return {name: style for name, style in plan.items()
                if getattr(model, name, None) is not None}

    if style in ("sp", "sp-local"):
        as_dtensor = style == "sp"  # "sp-local": plain local shards between blocks
        parallelize_module(model, mesh, outer({
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=not as_dtensor),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}))
        block_plan = {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1),
                                            use_local_output=not as_dtensor),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1),
                                               use_local_output=not as_dtensor)}
    else:
        parallelize_module(model, mesh,
                           outer({"tok_embeddings": RowwiseParallel(input_layouts=Replicate())}))
        block_plan = {"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                 "feed_forward.w3"):
        block_plan[name] = ColwiseParallel()
    for block in model.layers:
        parallelize_module(block, mesh, block_plan)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def plain_local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a layer input's data (through DTensor and collective wrappers)."""
    from swap_pass.runtime.freeing import local_tensor
    return local_tensor(t)


def state(model: nn.Module, attr: str) -> dict[str, torch.Tensor]:
    """Every parameter's ``attr`` (``"grad"`` or ``"data"``), local shards, cloned."""
    out = {}
    for name, p in model.named_parameters():
        value = p.grad if attr == "grad" else p.detach()
        out[name.replace("_checkpoint_wrapped_module.", "").replace("module.", "", 1)] = (
            None if value is None else local(value).clone())
    return out


def all_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a))
