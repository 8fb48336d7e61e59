"""One rank of SmartSwap's distributed tests: FSDP2 and tensor + sequence parallel, on gloo (CPU).

Each run builds the same tiny residual MLP twice from one seed, parallelizes both copies the same
way, trains one without swap_pass and one under ``SmartSwap`` for ``STEPS`` optimizer steps, and
writes what the test asserts on (every loss, gradient and parameter bitwise equal; bytes released;
the resident saved bytes against the budget) to ``rank{r}.json``.

* ``fsdp2``: ``fully_shard`` on each block and on the root (parameters are ``DTensor`` shards;
  FSDP2 all-gathers them into storages of its own and frees those itself after each forward).
* ``fsdp2-keep``: the same with ``reshard_after_forward=False`` (the all-gathered storages live
  from forward to backward, next to the activations).
* ``tp``: tensor + sequence parallel plans (``SequenceParallel`` norms, ``ColwiseParallel`` /
  ``RowwiseParallel`` with ``use_local_output=False``): parameters and the activations between
  blocks are ``DTensor`` s, saved as such.
* ``ddp``, ``fsdp2-ac``, ``tp-classic``: the setups of the same names of
  ``tests/distributed/dist_worker.py`` (its tiny Llama-style model; DDP, FSDP2 with
  ``checkpoint_wrapper`` on each block, and tensor parallel without SP, where the first block
  gets, and its norm saves, an ``AsyncCollectiveTensor``).
* ``pp-gpipe``, ``pp-1f1b``: one pipeline stage per rank (``torch.distributed.pipelining``,
  ``tests/eager/pp_worker.py``'s tiny Llama, 4 micro-batches), ``SmartSwap`` over the rank's
  stage module around the schedule's whole step.
* ``pp-fsdp2-gpipe``, ``pp-fsdp2-1f1b`` (:data:`PP_FSDP_RUNS`, on 4 ranks): the stages of
  ``tests/distributed/pp_fsdp_worker.py``, 2 stages x 2-way ``fully_shard``, mesh ``("pp", "dp")``;
  ``pp-tp-gpipe``, ``pp-tp-1f1b`` (:data:`PP_TP_RUNS`, the same 4 ranks): the same stages x the
  classic tensor-parallel plan on 2 ranks, mesh ``("pp", "tp")``.

``run(..., setup=...)`` trains other models the same way (torchtitan's, in
``tests/integrations/torchtitan_dist_worker.py``).
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

RUNS = ["fsdp2", "fsdp2-keep", "tp", "ddp", "fsdp2-ac", "tp-classic", "pp-gpipe", "pp-1f1b"]
PP_FSDP_RUNS = ["pp-fsdp2-gpipe", "pp-fsdp2-1f1b"]  # on 4 ranks
PP_TP_RUNS = ["pp-tp-gpipe", "pp-tp-1f1b"]  # on the same 4 ranks
TITAN_RUNS = ("ddp", "fsdp2-ac", "tp-classic")  # built by tests/distributed/dist_worker.py
STEPS, BATCH, SEQ, DIM, BLOCKS = 4, 2, 16, 64, 3
BUDGET = 0.5  # SmartSwap's memory_budget: a fraction of the profiled saved peak


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SavedSpy:
    """Saved-tensor hooks entered over SmartSwap's (passing every call through to them): keeps
    weak references to the local storages of saved ``DTensor`` s and ``AsyncCollectiveTensor`` s
    (also as a ``DTensor``'s local tensor) and the storages of saved parameters and parameter
    views (FSDP2's all-gathered ones), to be read when backward starts."""

    def __init__(self) -> None:
        self.wrapper_storages: dict[str, list] = {"dtensor": [], "collective": []}
        self.param_storages: dict[int, object] = {}
        self._hooks = None

    def __enter__(self) -> SavedSpy:
        import weakref

        from swap_pass.smart.saved import is_async_collective, is_dtensor, local_of
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (lambda t: t, lambda t: t)

        def spy_pack(t):
            inner = t._local_tensor if is_dtensor(t) else t
            if is_async_collective(inner):
                self.wrapper_storages["collective"].append(
                    weakref.ref(local_of(t).untyped_storage()))
            elif is_dtensor(t) and not getattr(t, "_is_param", False):
                self.wrapper_storages["dtensor"].append(weakref.ref(inner.untyped_storage()))
            elif type(t) is torch.Tensor or isinstance(t, nn.Parameter):
                base = t._base if t._base is not None else t
                if isinstance(base, nn.Parameter):
                    storage = t.untyped_storage()
                    self.param_storages[storage._cdata] = weakref.ref(storage)
            return pack(t)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(spy_pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def freed(self) -> dict[str, tuple[int, int]]:
        """Per kind (``"dtensor"``, ``"collective"``): (saved wrappers whose local storage is
        freed now, all of them)."""
        out = {}
        for kind, refs in self.wrapper_storages.items():
            live = [r() for r in refs]
            out[kind] = (sum(1 for s in live if s is not None and s.nbytes() == 0), len(live))
        return out


def _tracked_storages(smart) -> set[int]:
    """Storages SmartSwap's executor holds aliases of (its slots, by storage)."""
    return {key for key, ref in smart._executor.unit.slots.items() if ref() is not None}


def _parallelize(model: Net, run: str, mesh) -> Net:
    if run.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        reshard = run == "fsdp2"
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    plan = {"norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def _batch(run: str, rank: int, step: int, mesh):
    g = torch.Generator().manual_seed(100 + step)
    full = torch.randn(BATCH * 2, SEQ, DIM, generator=g)
    if run.startswith("fsdp2"):  # data parallel: each rank its half of the batch
        return full[rank * BATCH:(rank + 1) * BATCH].clone()
    from torch.distributed.tensor import DTensor, Shard
    local = full[:BATCH, rank * SEQ // 2:(rank + 1) * SEQ // 2].clone()  # same batch, seq shard
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False)


def _loss(out: torch.Tensor) -> torch.Tensor:
    loss = (out * out).mean()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def setup_of(run: str, rank: int, mesh):
    """``(model, batch, loss)`` of ``run``: ``batch(step)`` is the step's ``(input, *rest)``,
    ``loss(output, *rest)`` its loss. A fourth element, if any, runs the step's forward and
    backward itself (``forward_backward(batch, counter, smart, out)`` returns the losses; a
    pipeline schedule's step): the model is then the module SmartSwap is entered on."""
    if run in TITAN_RUNS:
        from tests.distributed import dist_worker as parallel
        from tests.distributed import models
        model = parallel._wrap(run, models.TinyTitan(), mesh)
        same_data = run.startswith("tp")  # TP ranks share the batch
        return model, lambda step: models.batch(step if same_data else 100 * step + rank), \
            models.loss_of
    if run.startswith(("pp-fsdp2-", "pp-tp-")):
        return _pipeline_fsdp(run, rank)
    if run.startswith("pp-"):
        return _pipeline(run, rank)
    model = _parallelize(Net(), run, mesh)
    return model, lambda step: (_batch(run, rank, step, mesh),), _loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(run: str, rank: int, mesh, smart_budget: float | None, setup=setup_of) -> dict:
    import swap_pass
    model, batch_of, loss_of, *custom = setup(run, rank, mesh)
    forward_backward = custom[0] if custom else _forward_backward(model, loss_of)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"losses": [], "grads": [], "released": [], "peaks": [], "stages": [],
           "in_flight": [], "evicted": [], "inputs_intact": True}
    smart = swap_pass.SmartSwap(model, memory_budget=smart_budget) if smart_budget else None
    if smart is not None:
        smart.__enter__()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                out["stages"].append(smart.stage.value if smart is not None else "none")
                _train_step(model, batch_of(step), forward_backward, opt, smart, out)
    finally:
        if smart is not None:
            smart.__exit__(None, None, None)
    out["params"] = [_local(p) for p in model.parameters()]
    if smart is not None:
        out["budget_bytes"] = smart.policy.budget_bytes
        out["plan_budgets"] = sorted(p.budget_bytes for p in smart.plan_cache.plans())
        out["feasible"] = smart.policy.feasible
        out["plan"] = smart.policy.summary()
    out["host_bytes_in_use"] = swap_pass.swap_stats().host_bytes_in_use
    out["skipped"] = dict(swap_pass.swap_stats().skipped_bytes)
    out["warnings"] = [str(w.message) for w in caught if "swap_pass" in str(w.message)]
    return out


def _train_step(model: nn.Module, batch: tuple, forward_backward, opt, smart, out: dict) -> None:
    """One optimizer step on ``batch``; what it did appended to ``out``."""
    import swap_pass
    from swap_pass.tools.smart_bench import ResidentSavedBytes
    batch_before = [_local(t) for t in batch]
    before = swap_pass.swap_stats().swapped_out_bytes
    with ResidentSavedBytes(model) as counter:
        losses = forward_backward(batch, counter, smart, out)
    out["losses"] += [loss.detach().clone() for loss in losses]
    out["grads"].append([_local(p.grad) for p in model.parameters()])
    out["inputs_intact"] &= all(torch.equal(_local(t), b)
                                for t, b in zip(batch, batch_before, strict=True))
    opt.step()
    opt.zero_grad(set_to_none=True)
    if smart is not None:
        smart.step()
        out["in_flight"].append(smart.last_report.max_in_flight)
        out["evicted"].append(smart.last_report.evicted_bytes)
    out["released"].append(swap_pass.swap_stats().swapped_out_bytes - before)
    out["peaks"].append(counter.peak)


def _forward_backward(model: nn.Module, loss_of):
    """One step's forward and backward of ``model`` on ``(input, *rest)``: its losses (one);
    also what :class:`SavedSpy` saw freed at backward's start, and FSDP2's all-gathered
    parameters SmartSwap tracks, in ``out``."""

    def forward_backward(batch, counter, smart, out: dict) -> list[torch.Tensor]:
        x, *rest = batch
        with SavedSpy() as spy:
            loss = loss_of(model(x), *rest)
            counter.sample()
            at_backward = []
            loss.register_hook(lambda g, seen=at_backward: seen.append(spy.freed()))
            if smart is not None:  # FSDP2's all-gathered parameters are never ours
                out["params_tracked"] = out.get("params_tracked", 0) + len(
                    _tracked_storages(smart) & set(spy.param_storages))
                out["params_saved"] = out.get("params_saved", 0) + len(spy.param_storages)
            loss.backward()
        for kind, freed in at_backward[0].items():
            out.setdefault(f"{kind}s_freed", []).append(freed)
        return [loss]
    return forward_backward


def _pipeline(run: str, rank: int) -> tuple:
    """``pp-gpipe``, ``pp-1f1b``: this rank's stage of ``tests/eager/pp_worker.py``'s tiny Llama
    (4 of 8 layers, the first stage embeds, the last projects) under ``ScheduleGPipe`` or
    ``Schedule1F1B``, ``MICROBATCHES`` micro-batches per step: ``(stage module, batch, None,
    forward_backward)``, the schedule running every micro-batch's forward and backward."""
    from swap_pass.tools.models import LlamaDecoderLayer, make_batch
    from tests.eager import pp_worker as pp
    cfg, per = pp._cfg(), pp.NUM_LAYERS // 2
    module = pp.Stage(cfg, rank * per, (rank + 1) * per, LlamaDecoderLayer, recompute=False)
    forward_backward = _schedule(run.removeprefix("pp-"), module, rank, pp.MICROBATCHES,
                                 (pp.BATCH // pp.MICROBATCHES, pp.SEQ), cfg.hidden_size,
                                 cfg.vocab_size, pp._loss)
    return module, lambda step: make_batch(cfg, pp.BATCH, pp.SEQ, seed=step), None, \
        forward_backward


_MESHES: dict = {}


def _pipeline_fsdp(run: str, rank: int) -> tuple:
    """``pp-fsdp2-gpipe``, ``pp-fsdp2-1f1b``, ``pp-tp-gpipe``, ``pp-tp-1f1b`` on 4 ranks:
    ``tests/distributed/pp_fsdp_worker.py``'s stages (2 stages x 2-way ``fully_shard`` per block
    and stage, mesh ``("pp", "dp")``, each data-parallel rank its own batch; or x the classic
    tensor-parallel plan on 2 ranks, mesh ``("pp", "tp")``, both ranks of a stage on one batch),
    under ``ScheduleGPipe`` or ``Schedule1F1B``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.distributed import models as m
    from tests.distributed import pp_fsdp_worker as pf
    world, kind = dist.get_world_size(), "tp" if run.startswith("pp-tp-") else "dp"
    if (world, kind) not in _MESHES:  # one mesh (its process groups) for every run of the process
        _MESHES[world, kind] = init_device_mesh("cpu", (pf.STAGES, world // pf.STAGES),
                                                mesh_dim_names=("pp", kind))
    mesh = _MESHES[world, kind]
    stage, dp_rank = mesh["pp"].get_local_rank(), mesh[kind].get_local_rank()
    module = pf.StageModel(stage)
    if kind == "tp":
        m.apply_tp(module, mesh["tp"], "classic")
        dp_rank = 0  # both tensor-parallel ranks: one batch
    else:
        for block in module.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    forward_backward = _schedule(run.rsplit("-", 1)[1], module, stage, pf.MICROBATCHES,
                                 (pf.BATCH // pf.MICROBATCHES, m.SEQ), m.DIM, m.VOCAB,
                                 m.loss_of, group=mesh["pp"].get_group())
    return module, lambda step: pf._batch(step, dp_rank), None, forward_backward


def _schedule(name: str, module: nn.Module, stage: int, micro_batches: int, tokens: tuple,
              dim: int, vocab: int, loss_fn, group=None):
    """``forward_backward`` of a 2-stage pipeline schedule (``"gpipe"`` or ``"1f1b"``) over
    ``module``, stage ``stage``: ``(tokens, labels)`` in, the last stage's losses out (one per
    micro-batch of ``tokens`` shape).

    The stages get their input and output shapes up front (static metadata): without them
    torch 2.13 infers the shapes with a forward of the first micro-batch on the first step,
    whose autograd graph the first stage keeps alive for good, with and without swap_pass
    (and with SmartSwap, the host copies of what it swapped of it)."""
    from torch.distributed import pipelining
    hidden = torch.empty(*tokens, dim, requires_grad=True)
    inputs = torch.zeros(tokens, dtype=torch.long) if stage == 0 else hidden
    outputs = hidden if stage == 0 else torch.empty(*tokens, vocab)
    pipe = pipelining.PipelineStage(module, stage, 2, torch.device("cpu"), input_args=inputs,
                                    output_args=outputs, group=group)
    schedule = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[name]
    sched = schedule(pipe, n_microbatches=micro_batches, loss_fn=loss_fn)

    def forward_backward(batch, counter, smart, out: dict) -> list[torch.Tensor]:
        ids, labels = batch
        losses: list[torch.Tensor] = []  # the last stage's, one per micro-batch
        sched.step(*([ids] if stage == 0 else []), target=labels, losses=losses)
        return losses
    return forward_backward


def _compare(ref: dict, got: dict) -> dict:
    def eq(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    return {
        "losses_equal": eq(ref["losses"], got["losses"]),
        "grads_equal": len(ref["grads"]) == len(got["grads"]) and all(
            eq(a, b) for a, b in zip(ref["grads"], got["grads"], strict=True)),
        "params_equal": eq(ref["params"], got["params"]),
        "released": got["released"], "stages": got["stages"],
        "peaks": got["peaks"], "unswapped_peaks": ref["peaks"],
        "budget_bytes": got["budget_bytes"], "feasible": got["feasible"], "plan": got["plan"],
        "inputs_intact": got["inputs_intact"] and ref["inputs_intact"],
        "host_bytes_in_use": got["host_bytes_in_use"],
        "n_losses": len(got["losses"]), "in_flight": got["in_flight"], "evicted": got["evicted"],
        "warnings": got["warnings"], "plan_budgets": got["plan_budgets"],
        **{k: got[k] for k in ("dtensors_freed", "collectives_freed", "params_tracked",
                                "params_saved") if k in got},
        "skipped": {str(k): v for k, v in got["skipped"].items()},
    }


def run(rank: int, world: int, port: int, outdir: str, runs: list[str] | None = None,
        setup=setup_of, budget: float = BUDGET) -> None:
    """Entry point for ``torch.multiprocessing.spawn``: each of ``runs`` (default :data:`RUNS`)
    without and with ``SmartSwap(model, memory_budget=budget)``; ``setup`` builds them (default
    :func:`setup_of`; a module-level function, to reach the spawned ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    import swap_pass
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name in runs or RUNS:
            swap_pass.reset()
            ref = _train(name, rank, mesh, None, setup)
            swap_pass.reset()
            got = _train(name, rank, mesh, budget, setup)
            results[name] = _compare(ref, got)
    except Exception as e:  # reported to the test, which fails with it
        import traceback
        results["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
