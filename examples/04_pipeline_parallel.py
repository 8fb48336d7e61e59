"""Pipeline parallel with swap: 2 stages, 4 micro-batches in flight, ``Schedule1F1B``, gloo on CPU.

Run it with::

    torchrun --nproc-per-node 2 examples/04_pipeline_parallel.py

Each rank holds half of the layers. ``enable_swap_layer_input`` gives every layer a manager whose
``batch_stack`` FIFO holds one group per micro-batch in flight, so each backward gets the input
of its own forward back. Gradients are compared bitwise with the same schedule without swap.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

CFG = LlamaConfig(hidden_size=64, num_layers=8, num_heads=4, intermediate_size=176)
BATCH, SEQ, MICRO_BATCHES = 8, 128, 4


class Stage(nn.Module):
    """One rank's share of :class:`LlamaStyleModel`: embedding or not, its layers, head or not."""

    def __init__(self, full: LlamaStyleModel, rank: int, world: int) -> None:
        super().__init__()
        per = len(full.layers) // world
        self.first, self.last = rank == 0, rank == world - 1
        self.embed = full.embed if self.first else None
        self.layers = nn.ModuleList(full.layers[rank * per:(rank + 1) * per])
        self.norm = full.norm if self.last else None
        self.lm_head = full.lm_head if self.last else None
        self.register_buffer("cos", full.cos_table[:SEQ].clone(), persistent=False)
        self.register_buffer("sin", full.sin_table[:SEQ].clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.first else x
        for layer in self.layers:  # full recompute: each layer keeps only its input
            h = checkpoint(layer, h, self.cos, self.sin, use_reentrant=False)
        return self.lm_head(self.norm(h)).float() if self.last else h


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def train_step(stage_module: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    """One 1F1B step over 4 micro-batches; returns this rank's parameter gradients."""
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    x, y = make_batch(CFG, BATCH, SEQ, seed=0)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])
    return [p.grad.clone() for p in stage_module.parameters()]


def swapped_step(stage_module: nn.Module, rank: int, world: int) -> tuple[list[torch.Tensor], int]:
    """The same step with the layer inputs swapped to host memory (all but the last; a stage's
    received activations are the pipeline's own and stay on the device)."""
    handle = swap_pass.enable_swap_layer_input(stage_module)
    try:
        grads = train_step(stage_module, rank, world)
    finally:
        handle.remove()
    return grads, swap_pass.swap_stats().swap_outs


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = LlamaStyleModel(CFG)
    plain = Stage(full, rank, world)
    swapped = copy.deepcopy(plain)
    expected = train_step(plain, rank, world)
    got, swap_outs = swapped_step(swapped, rank, world)
    same = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    ok = torch.tensor([int(same and swap_outs > 0)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    print(f"rank {rank}: gradients bitwise equal: {same}; groups swapped out: {swap_outs}")
    dist.destroy_process_group()
    if rank == 0:
        print("OK: 1F1B with swap matches 1F1B without swap" if ok.item() else "FAILED")
    return 0 if ok.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
