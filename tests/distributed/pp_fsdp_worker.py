"""One rank of the pipeline x FSDP2 and pipeline x tensor-parallel tests: 4 gloo ranks (CPU),
a 2-D mesh ``("pp", "dp")`` or ``("pp", "tp")``.

The tiny Llama of ``models.py`` with ``STAGES * LAYERS_PER_STAGE`` blocks is split into 2 pipeline
stages (ranks ``{0, 1}`` hold stage 0, ``{2, 3}`` stage 1); each stage's blocks and the stage are
``fully_shard``-ed over the stage's 2-rank ``dp`` mesh (``SCHEDULES``), or its blocks and embedding
take the classic tensor-parallel plan over the 2-rank ``tp`` mesh (``TP_SCHEDULES``: both ranks of a
stage see one batch), and ``torch.distributed.pipelining`` runs ``MICROBATCHES`` micro-batches per
step (``ScheduleGPipe`` or ``Schedule1F1B``). ``STEPS`` AdamW steps, once without swap and once with
``enable_swap_layer_input`` on the stage module; the rank writes to ``rank<r>.json`` what the test
asserts on: the last stage's losses, every gradient of every step and every parameter after the last
step ``torch.equal`` (local shards), the stage's block inputs freed at the end of the first forward,
bytes released, nothing pending, the batch intact. ``COMPILED_SCHEDULES`` and
``TP_LATER_COMPILED``: the same with each stage's blocks compiled by ``swap_pass.compile_layers``
(aot_eager), with and without swap.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

STAGES, LAYERS_PER_STAGE, MICROBATCHES, BATCH, STEPS = 2, 4, 4, 4, 3
# Pipeline x FSDP2 on the mesh ("pp", "dp"), then pipeline x classic tensor parallel on the mesh
# ("pp", "tp") of the same 4 ranks.
SCHEDULES = ["gpipe", "1f1b"]
TP_SCHEDULES = ["tp-gpipe", "tp-1f1b"]
# Pipeline x tensor + sequence parallel: DTensor activations between blocks and stages.
SP_SCHEDULES = ["sp-gpipe", "sp-1f1b"]
# Pipeline x FSDP2, each stage's blocks compiled by ``swap_pass.compile_layers`` (aot_eager), the
# reference the same per-block compile without swap.
COMPILED_SCHEDULES = ["gpipe-compiled", "1f1b-compiled"]
# Pipeline x classic TP compiled the same way, the first stage's first block left eager
# (``compile_layers(..., layers=...)`` on the others): compiled, that block's backward fails in
# torch without swap too (tests/distributed/test_compile_layers.py).
TP_LATER_COMPILED = ["tp-gpipe-compiled-later", "tp-1f1b-compiled-later"]


class StageModel(nn.Module):
    """Stage ``stage`` of the model: the embedding on the first stage, its blocks in ``layers``,
    the norm and output on the last. Every rank builds the whole model with one seed and keeps its
    share, so the stages' weights are those of one model."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        from tests.distributed import models as m
        torch.manual_seed(0)
        embed = nn.Embedding(m.VOCAB, m.DIM)
        blocks = [m.Block() for _ in range(STAGES * LAYERS_PER_STAGE)]
        norm, output = nn.RMSNorm(m.DIM), nn.Linear(m.DIM, m.VOCAB, bias=False)
        last = stage == STAGES - 1
        self.tok_embeddings = embed if stage == 0 else None
        self.layers = nn.ModuleList(blocks[stage * LAYERS_PER_STAGE:(stage + 1) * LAYERS_PER_STAGE])
        self.norm, self.output = (norm, output) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's batch: the same on both stages of a pipeline."""
    from tests.distributed import models as m
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    tokens = torch.randint(0, m.VOCAB, (BATCH, m.SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _tp_mesh_of(mesh):
    """The callback with which a stage re-wraps a received plain tensor as the DTensor the previous
    stage sent (torchtitan passes its own): the stage's ``tp`` mesh for every name."""
    return lambda names, layout: mesh["tp"]


def _build(schedule: str, mesh, swap: bool):
    from torch.distributed import pipelining as pp
    from torch.distributed.fsdp import fully_shard

    import swap_pass
    from tests.distributed import models as m
    stage_idx = mesh["pp"].get_local_rank()
    model = StageModel(stage_idx)
    compiled = "-compiled" in schedule
    handle = swap_pass.enable_swap_layer_input(model) if swap and not compiled else None
    get_mesh = None
    if schedule.startswith("sp-"):  # DTensor activations, also across the stage boundary
        m.apply_tp(model, mesh["tp"], "sp")
        get_mesh = _tp_mesh_of(mesh)
    elif schedule.startswith("tp-"):  # classic plan: the embedding's all-reduce, Megatron-style
        m.apply_tp(model, mesh["tp"], "classic")
    else:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if compiled:  # per-block compile as torchtitan does it, after parallelizing
        from torch import _dynamo
        _dynamo.reset()
        _dynamo.utils.counters.clear()  # graphs and breaks of this compile alone
        later = schedule.endswith("-later") and stage_idx == 0  # the first block left eager
        layers = list(model.layers)[1:] if later else None
        handle = swap_pass.compile_layers(model, backend="aot_eager", layers=layers,
                                          swap=swap).swap
    stage = pp.PipelineStage(model, stage_idx, STAGES, torch.device("cpu"),
                             group=mesh["pp"].get_group(), get_mesh=get_mesh)
    cls = pp.ScheduleGPipe if "gpipe" in schedule else pp.Schedule1F1B
    return model, handle, cls(stage, n_microbatches=MICROBATCHES, loss_fn=m.loss_of)


def _watch(model):
    """Pre-hooks keeping each block's forward input, and after the stage's forward whether each
    one's storage is freed (the first micro-batch's forward is the one the test reads)."""
    from swap_pass.runtime.freeing import in_backward
    from tests.distributed.models import plain_local
    seen: list[torch.Tensor] = []
    freed: list[list[bool]] = []
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args: None if in_backward() else seen.append(args[0]))
        for layer in model.layers]

    def after(mod, args, out):
        freed.append([plain_local(x).untyped_storage().nbytes() == 0 for x in seen])
        seen.clear()

    hooks.append(model.register_forward_hook(after))
    return hooks, freed


def _train(schedule: str, mesh, swap: bool) -> dict:
    import swap_pass
    from tests.distributed import models as m
    from tests.distributed.dist_worker import _graphs, close_record
    swap_pass.reset()
    model, handle, sched = _build(schedule, mesh, swap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks, freed = _watch(model)
    rec: dict = {"losses": [], "grads": [], "outs": [], "intact": True, "clean": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            dp_rank = mesh["dp"].get_local_rank() if "dp" in mesh.mesh_dim_names else 0
            tokens, labels = _batch(step, dp_rank)  # both tensor-parallel ranks: one batch
            kept = (tokens.clone(), labels.clone())
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            args = (tokens,) if mesh["pp"].get_local_rank() == 0 else ()
            sched.step(*args, target=labels, losses=losses)
            rec["losses"].append([loss.detach() for loss in losses])
            rec["grads"].append(m.state(model, "grad"))
            opt.step()
            stats = swap_pass.swap_stats()
            rec["outs"].append(stats.swap_outs)
            rec["intact"] &= torch.equal(tokens, kept[0]) and torch.equal(labels, kept[1])
            pending = sum(len(mgr.batch_stack) for mgr in handle.managers) if handle else 0
            rec["clean"] &= pending == 0 and stats.host_bytes_in_use == 0
    for hook in hooks:
        hook.remove()
    if "-compiled" in schedule:
        rec["compiled"] = _graphs(None)
    return close_record(rec, caught, handle, params=m.state(model, "data"), freed=freed[0])


def _compare(ref: dict, got: dict) -> dict:
    from tests.distributed import models as m
    return {
        "losses_equal": all(len(a) == len(b) and all(torch.equal(x, y)
                                                     for x, y in zip(a, b, strict=True))
                            for a, b in zip(ref["losses"], got["losses"], strict=True)),
        "n_losses": [len(x) for x in got["losses"]],
        "grads_equal": all(m.all_equal(a, b)
                           for a, b in zip(ref["grads"], got["grads"], strict=True)),
        "grads_present": all(v is not None for g in got["grads"] for v in g.values()),
        "params_equal": m.all_equal(ref["params"], got["params"]),
        "n_params": len(got["params"]), "ref_outs": ref["outs"][-1],
        **{k: got[k] for k in ("outs", "freed", "released", "swapped_in", "skipped", "clean",
                                "warnings")},
        "compiled": got.get("compiled"),
        "intact": got["intact"] and ref["intact"],
    }


def run(rank: int, world: int, port: int, out_dir: str, schedules: list[str]) -> None:
    """Entry point for ``torch.multiprocessing`` (``rank`` first)."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.distributed.dist_worker import init, run_setups
    init(rank, world, port)
    shape = (STAGES, world // STAGES)
    meshes = {"dp": init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp")),
              "tp": init_device_mesh("cpu", shape, mesh_dim_names=("pp", "tp"))}
    mesh = meshes["dp"]
    report: dict = {"stage": mesh["pp"].get_local_rank(), "dp_rank": mesh["dp"].get_local_rank()}
    run_setups(rank, out_dir, schedules,
               lambda schedule, swap: _train(
                   schedule, meshes["tp"] if schedule.startswith(("tp-", "sp-")) else mesh, swap),
               compare_runs=_compare, report=report)
