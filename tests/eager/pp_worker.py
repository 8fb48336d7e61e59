"""One rank of the pipeline-parallel test: real ``torch.distributed.pipelining`` on gloo (CPU).

Each rank trains the same 8-layer tiny Llama split into stages, once without swap and once with
layers carrying MindSpeed's decorators, under Schedule1F1B, ScheduleGPipe and
ScheduleInterleaved1F1B, and writes what the test asserts on (exact equality, swaps done, nothing
pending) to a JSON file.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

NUM_LAYERS, MICROBATCHES, BATCH, SEQ = 8, 4, 8, 8
# "raw": the first stage has no embedding; the micro-batch views of the user's hidden-states
# tensor go straight into the first swapped layer.
RUNS = ["1f1b-plain", "1f1b-recompute", "gpipe-plain", "interleaved-plain", "interleaved-recompute",
        "1f1b-raw-plain", "1f1b-raw-recompute", "gpipe-raw-plain", "gpipe-raw-recompute",
        "interleaved-raw-plain", "interleaved-raw-recompute"]


def _parse(run: str) -> tuple[str, bool, bool]:
    """``"1f1b-raw-recompute"`` -> ``("1f1b", True, True)``: schedule, recompute, raw."""
    parts = run.split("-")
    return parts[0], parts[-1] == "recompute", "raw" in parts


def expected_swaps_per_step(run: str, rank: int) -> int:
    """Layer inputs swapped per step: the raw batch views (user data) stay on the device, and so
    does the input of each rank's last layer; a stage's received activations are swapped."""
    schedule, _, raw = _parse(run)
    stages = [rank + 2 * k for k in range(2 if schedule == "interleaved" else 1)]
    per_stage = NUM_LAYERS // (2 * len(stages))
    swapped = len(stages) * per_stage - 1  # one tag per rank: its last layer keeps its input
    swapped -= sum(1 for s in stages if s == 0 and raw)  # first layer fed the user's views
    return MICROBATCHES * swapped


def _cfg():
    from swap_pass.tools.models import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=32, num_layers=NUM_LAYERS, num_heads=2,
                       intermediate_size=48, max_seq_len=SEQ)


class Stage(nn.Module):
    """Layers ``[lo, hi)`` of the model; the first stage embeds (unless ``raw``), the last projects.

    With ``raw`` the schedule's input is already hidden states: the micro-batches, views of the
    one batch tensor the user passed, go straight into the first layer.
    """

    def __init__(self, cfg, lo: int, hi: int, layer_cls, recompute: bool,
                 raw: bool = False) -> None:
        super().__init__()
        from swap_pass.tools.models import LlamaStyleModel
        torch.manual_seed(0)
        full = LlamaStyleModel(cfg)  # same weights on every rank and run
        self.first, self.last, self.recompute = lo == 0, hi == cfg.num_layers, recompute
        self.embed = full.embed if self.first and not raw else None
        self.layers = nn.ModuleList()
        for idx in range(lo, hi):
            layer = layer_cls(cfg)
            layer.load_state_dict(full.layers[idx].state_dict())
            self.layers.append(layer)
        self.norm, self.lm_head = (full.norm, full.lm_head) if self.last else (None, None)
        self.register_buffer("cos", full.cos_table, persistent=False)
        self.register_buffer("sin", full.sin_table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            if self.recompute:
                h = checkpoint(layer, h, self.cos, self.sin, use_reentrant=False)
            else:
                h = layer(h, self.cos, self.sin)
        return self.lm_head(self.norm(h)).float() if self.last else h


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _build(schedule: str, rank: int, layer_cls, recompute: bool, raw: bool = False):
    from torch.distributed import pipelining as pp
    cfg = _cfg()
    n_stages = 4 if schedule == "interleaved" else 2
    per = NUM_LAYERS // n_stages
    ids = [rank + 2 * k for k in range(n_stages // 2)]  # interleaved: rank 0 holds 0 and 2
    mods = [Stage(cfg, i * per, (i + 1) * per, layer_cls, recompute, raw) for i in ids]
    stages = [pp.PipelineStage(m, i, n_stages, torch.device("cpu"))
              for m, i in zip(mods, ids, strict=True)]
    if schedule == "interleaved":
        sched = pp.ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=_loss)
    else:
        cls = pp.Schedule1F1B if schedule == "1f1b" else pp.ScheduleGPipe
        sched = cls(stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    return mods, sched


def _inputs(raw: bool, ids: torch.Tensor, step: int) -> torch.Tensor:
    if not raw:
        return ids
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, _cfg().hidden_size, generator=gen)


def _step(schedule: str, rank: int, layer_cls, recompute: bool, steps: int = 2, raw: bool = False):
    import swap_pass
    from swap_pass.tools.models import make_batch
    mods, sched = _build(schedule, rank, layer_cls, recompute, raw)
    record = {"losses": [], "clean": [], "inputs_intact": []}
    for step in range(steps):
        for m in mods:
            m.zero_grad(set_to_none=True)
        ids, labels = make_batch(_cfg(), BATCH, SEQ, seed=step)
        losses: list[torch.Tensor] = []
        if rank == 0:
            inputs = _inputs(raw, ids, step)
            before = inputs.clone()
            sched.step(inputs, target=labels, losses=losses)
            record["inputs_intact"].append(torch.equal(inputs, before))
        else:
            sched.step(target=labels, losses=losses)
        record["losses"] += [loss.detach() for loss in losses]
        record.setdefault("outs_per_step", []).append(swap_pass.swap_stats().swap_outs)
        pending = sum(len(layer.swap_manager.batch_stack) for m in mods for layer in m.layers
                      if hasattr(layer, "swap_manager"))
        record["clean"].append(pending == 0 and swap_pass.swap_stats().host_bytes_in_use == 0)
    record["grads"] = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods)
                       for n, p in m.named_parameters()}
    record["swap_outs"] = swap_pass.swap_stats().swap_outs
    return record


def _compare(ref: dict, got: dict) -> dict:
    return {
        "losses_equal": len(ref["losses"]) == len(got["losses"]) and all(
            torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"], strict=True)),
        "grads_equal": ref["grads"].keys() == got["grads"].keys() and all(
            torch.equal(ref["grads"][k], got["grads"][k]) for k in ref["grads"]),
        "swap_outs": got["swap_outs"], "ref_swap_outs": ref["swap_outs"],
        "clean": all(got["clean"]), "n_losses": len(got["losses"]),
        "outs_per_step": got["outs_per_step"],
        "inputs_intact": all(got["inputs_intact"]) and all(ref["inputs_intact"]),
    }


def train_compiled(setup: str, rank: int, swap: bool) -> dict:
    """``setup`` (``"pp-1f1b-compile-layers"``, ``"pp-gpipe-compile-layers"``): this rank's stage
    of the 2-stage pipeline, its blocks compiled by ``swap_pass.compile_layers`` (aot_eager) with
    or without ``swap``, three AdamW steps; the record ``tests.distributed.dist_worker.compare``
    reads (the losses on the last stage only; no end-of-forward watch: ``freed`` is None)."""
    import warnings

    import torch._dynamo

    import swap_pass
    from swap_pass.tools.models import LlamaDecoderLayer, make_batch
    from tests.distributed.dist_worker import STEPS, _graphs, close_record
    schedule = setup.split("-")[1]
    swap_pass.reset()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs and breaks of this compile alone
    (mod,), sched = _build(schedule, rank, LlamaDecoderLayer, recompute=False)
    handle = swap_pass.compile_layers(mod, backend="aot_eager", swap=swap).swap
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-2)
    rec: dict = {"losses": [], "grads": [], "outs": [], "intact": True, "clean": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            ids, labels = make_batch(_cfg(), BATCH, SEQ, seed=step)
            losses: list[torch.Tensor] = []
            if rank == 0:
                kept = ids.clone()
                sched.step(ids, target=labels, losses=losses)
                rec["intact"] &= torch.equal(ids, kept)
            else:
                sched.step(target=labels, losses=losses)
            rec["losses"] += [loss.detach() for loss in losses]
            rec["grads"].append({n: p.grad.clone() for n, p in mod.named_parameters()})
            opt.step()
            stats = swap_pass.swap_stats()
            rec["outs"].append(stats.swap_outs)
            pending = sum(len(m.batch_stack) for m in handle.managers) if handle else 0
            rec["clean"] &= pending == 0 and stats.host_bytes_in_use == 0
    rec["compiled"] = _graphs(None)
    return close_record(rec, caught, handle, freed=None, n_losses=len(rec["losses"]),
                        params={n: p.detach().clone() for n, p in mod.named_parameters()})


def run(rank: int, world: int, port: int, outdir: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn``."""
    import swap_pass
    from swap_pass.tools.models import LlamaDecoderLayer
    from tests.eager.helpers import SwapLlamaLayer
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    try:
        for name in RUNS:
            schedule, recompute, raw = _parse(name)
            swap_pass.reset()
            ref = _step(schedule, rank, LlamaDecoderLayer, recompute, raw=raw)
            swap_pass.reset()
            got = _step(schedule, rank, SwapLlamaLayer, recompute, raw=raw)
            results[name] = _compare(ref, got)
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


if __name__ == "__main__":  # manual run: python -m tests.eager.pp_worker OUTDIR PORT
    import torch.multiprocessing as mp
    mp.spawn(run, args=(2, int(sys.argv[2]), sys.argv[1]), nprocs=2)
