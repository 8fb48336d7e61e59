"""One rank of the distributed tests: real torch.distributed on gloo (CPU), several setups in one
process pair (a spawn costs seconds of interpreter start and torch import).

Each setup trains ``TinyTitan`` for ``STEPS`` optimizer steps twice, without and with
``enable_swap_layer_input``, and writes what the tests assert on to ``rank<r>.json``: losses,
every gradient of every step and every parameter after the last step compared with
``torch.equal`` (local shards of DTensors), the layer inputs freed at the end of the first
forward, bytes swapped and released on this rank, nothing left pending, the user's batch intact.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

STEPS = 3
# "tp-sp-local": sequence parallel with plain local shards between blocks (torchtitan up to 0.2's
# plans, the default use_local_output), no AC.
SETUPS = ["ddp-before", "ddp-after", "fsdp2", "fsdp2-ac", "fsdp2-reshard-false", "tp-sp",
          "tp-sp-ac", "tp-sp-local", "tp-classic", "docs-recipe"]
# Each block compiled with swap_pass.compile_layers (aot_eager), against the same compile without
# swap: in their own process pair.
COMPILE_SETUPS = ["fsdp2-compile-layers", "fsdp2-ac-compile-layers", "tp-sp-compile-layers"]
# Per-block compile of the classic TP plan: fails in torch itself (AOTAutograd on the first
# block, whose input is an AsyncCollectiveTensor), without swap_pass too; reported, not trained.
CLASSIC_TP_COMPILE = "tp-classic-compile-layers"
# Pipeline parallel, 2 stages on the 2 ranks (tests/eager/pp_worker.py's model and schedules),
# each stage's blocks compiled with swap_pass.compile_layers, against the same without swap.
PP_COMPILE_SETUPS = ["pp-1f1b-compile-layers", "pp-gpipe-compile-layers"]
# The whole model (the DDP module for DDP) compiled with torch.compile(model,
# backend=make_swap_backend("aot_eager")) in layer-input mode ("-compile-model") and budget mode
# ("-compile-budget"), against the same whole-model compile with the plain aot_eager backend:
# their own process pair.
MODEL_COMPILE_SETUPS = ["ddp-compile-model", "fsdp2-compile-model", "fsdp2-compile-budget",
                        "fsdp2-ac-compile-model",
                        "tp-sp-compile-model", "tp-sp-compile-budget", "tp-classic-compile-model"]
MODEL_COMPILE_BUDGET = 0.5
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "distributed.md")


def docs_recipe() -> str:
    """The code block under ``<!-- recipe: ... -->`` in docs/distributed.md."""
    import re
    with open(DOCS) as f:
        match = re.search(r"<!-- recipe:[^>]*-->\n```python\n(.*?)```", f.read(), re.DOTALL)
    assert match, "docs/distributed.md has no recipe block"
    return match.group(1)


def _wrap(setup: str, model, mesh):
    """Apply ``setup``'s parallelism to ``model``; returns the module to call."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from tests.distributed import models as m
    if setup.startswith("tp") or setup == "docs-recipe":  # torchtitan's order: TP, AC, DP
        style = ("classic" if setup.startswith("tp-classic") else
                 "sp-local" if setup.startswith("tp-sp-local") else "sp")
        m.apply_tp(model, mesh, style)
    if setup.endswith("-ac") or "-ac-" in setup:  # checkpoint_wrapper per block
        for idx, block in enumerate(model.layers):
            model.layers[idx] = checkpoint_wrapper(block)
    if setup.startswith("ddp"):
        return DistributedDataParallel(model)
    if setup.startswith("fsdp2"):
        reshard = setup != "fsdp2-reshard-false"
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _blocks(inner) -> list:
    layers = inner.layers
    return list(layers.values() if hasattr(layers, "values") else layers)


def _watch_inputs(inner):
    """Pre-hooks that keep each block's first-forward input, and whether each one's data was off
    the device when the final norm ran (the end of the blocks' forward)."""
    from swap_pass.runtime.freeing import in_backward
    from tests.distributed import models as m
    seen, freed = [], []
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args: None if in_backward() else seen.append(args[0]))
        for layer in _blocks(inner)]
    hooks.append(inner.norm.register_forward_pre_hook(lambda mod, args: freed.append(
        [m.plain_local(x).untyped_storage().nbytes() == 0 for x in seen])))
    return hooks, freed


def _compile_model(setup: str, model, swap: bool):
    """``model`` compiled whole: with ``make_swap_backend("aot_eager")`` (budget mode for a
    ``"-compile-budget"`` setup, a cost model in which every copy hides) if ``swap``, else with
    the plain ``aot_eager`` backend."""
    import torch._dynamo

    from swap_pass.graph.backend import make_swap_backend
    from swap_pass.graph.budget import CostModel
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs and breaks of this compile alone
    knobs = {}
    if setup.endswith("compile-budget"):  # every copy hides: the choice goes by bytes alone
        knobs = {"memory_budget": MODEL_COMPILE_BUDGET,
                 "cost_model": CostModel(copy_bytes_per_s=1e12, flops_per_s=1e12)}
    backend = make_swap_backend("aot_eager", **knobs) if swap else "aot_eager"
    return torch.compile(model, backend=backend), backend


def _graphs(backend) -> dict:
    """What Dynamo and the swap backend made: graphs, breaks, and per rewritten partition its
    mode, swapped tensors and bytes."""
    from torch._dynamo.utils import counters
    parts = getattr(backend, "partitions", ())
    return {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted({reason.splitlines()[0] for reason in counters["graph_break"]}),
            "partitions": [[p.mode, len(p.swapped), sum(s.nbytes for s in p.swapped)]
                           for p in parts]}


def _train(setup: str, rank: int, mesh, swap: bool) -> dict:
    import swap_pass
    from tests.distributed import models as m
    swap_pass.reset()
    inner = m.TinyTitan()
    handle = None
    compiled = setup.endswith("compile-layers")  # regional compile: swap_pass.compile_layers
    whole = setup in MODEL_COMPILE_SETUPS  # torch.compile(model), the swap inside the graphs
    if swap and not (compiled or whole) and setup not in ("ddp-after", "docs-recipe"):
        handle = swap_pass.enable_swap_layer_input(inner)
    model = _wrap(setup, inner, mesh)
    if swap and setup == "ddp-after":
        handle = swap_pass.enable_swap_layer_input(model)
    if swap and setup == "docs-recipe":  # the page's block, as written, on the TP + SP model
        names = {"model": model}
        exec(compile(docs_recipe(), DOCS, "exec"), names)  # noqa: S102 - the docs' own code
        handle = names["handle"]
    if compiled:  # per-layer compile as torchtitan does it; the reference: the same, no swap
        import torch._dynamo

        from swap_pass.graph.regional import compile_layers
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()  # graphs and breaks of this compile alone
        handle = compile_layers(inner, backend="aot_eager", swap=swap).swap
    if whole:
        model, backend = _compile_model(setup, model, swap)
    same_data = setup.startswith("tp") or setup == "docs-recipe"  # TP ranks share the batch
    seeds = [step if same_data else 100 * step + rank for step in range(STEPS)]
    rec = train_steps(model, inner, handle, [m.batch(seed) for seed in seeds], m.loss_of,
                      watch=not whole)
    if whole or compiled:
        rec["compiled"] = _graphs(backend if whole else None)
    return rec


def train_steps(model, inner, handle, batches: list, loss_fn, *, watch: bool = True) -> dict:
    """One optimizer step per batch of ``(tokens, labels)``; what :func:`compare` reads.

    ``inner`` is the model whose ``layers`` and ``norm`` are watched (unless not ``watch``: a
    model compiled whole, whose hooks Dynamo would trace) and whose parameters are compared
    (the module inside a DDP wrapper); ``handle`` is the swap handle, or None.
    """
    import swap_pass
    from tests.distributed import models as m
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks, freed = _watch_inputs(inner) if watch else ([], [None])
    rec: dict = {"losses": [], "grads": [], "outs": [], "intact": True, "clean": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens, labels in batches:
            kept = tokens.clone()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(tokens), labels)
            loss.backward()
            rec["losses"].append(loss.detach())
            rec["grads"].append(m.state(inner, "grad"))
            opt.step()
            stats = swap_pass.swap_stats()
            rec["outs"].append(stats.swap_outs)
            rec["intact"] &= torch.equal(tokens, kept)
            pending = sum(len(mgr.batch_stack) for mgr in handle.managers) if handle else 0
            rec["clean"] &= pending == 0 and stats.host_bytes_in_use == 0
    for hook in hooks:
        hook.remove()
    return close_record(rec, caught, handle, params=m.state(inner, "data"), freed=freed[0])


def close_record(rec: dict, caught: list, handle, **fields) -> dict:
    """``rec`` with ``fields``, the run's swap figures and swap_pass's warnings (``caught``);
    ``handle`` (if any) removed."""
    import swap_pass
    stats = swap_pass.swap_stats()
    rec.update(fields, released=stats.peak_device_bytes_released,
               swapped_in=stats.swapped_in_bytes, skipped=stats.skipped_bytes,
               warnings=[str(w.message) for w in caught if "swap_pass" in str(w.message)])
    if handle is not None:
        handle.remove()
    return rec


def compare(ref: dict, got: dict) -> dict:
    from tests.distributed import models as m
    return {
        "losses_equal": all(torch.equal(a, b)
                            for a, b in zip(ref["losses"], got["losses"], strict=True)),
        "grads_equal": all(m.all_equal(a, b)
                           for a, b in zip(ref["grads"], got["grads"], strict=True)),
        "params_equal": m.all_equal(ref["params"], got["params"]),
        "n_params": len(got["params"]),
        "ref_outs": ref["outs"][-1], "outs": got["outs"], "freed": got["freed"],
        "released": got["released"], "swapped_in": got["swapped_in"], "skipped": got["skipped"],
        "clean": got["clean"], "intact": got["intact"] and ref["intact"],
        "warnings": got["warnings"], "compiled": got.get("compiled"),
        "n_losses": len(got["losses"]),
    }


def classic_tp_per_block_compile(mesh) -> dict[str, str]:
    """One forward and backward of the classic TP plan (``apply_tp(..., "classic")``) with each
    block's forward compiled (aot_eager) by plain ``torch.compile`` (``"torch"``), by
    ``swap_pass.compile_layers`` (``"swap_pass"``), and by plain ``torch.compile`` on every block
    but the first (``"later_blocks"``, whose input is a plain tensor, not the embedding's
    ``AsyncCollectiveTensor``): each one's error (``"Type: message"``), or ``""``."""
    import torch._dynamo

    import swap_pass
    from tests.distributed import models as m
    out = {}
    for how in ("torch", "swap_pass", "later_blocks"):
        torch._dynamo.reset()
        swap_pass.reset()
        model = m.TinyTitan()
        m.apply_tp(model, mesh, "classic")
        handle = None
        if how == "swap_pass":
            handle = swap_pass.compile_layers(model, backend="aot_eager")
        else:
            for block in list(model.layers)[how == "later_blocks":]:
                block.forward = torch.compile(block.forward, backend="aot_eager")
        tokens, labels = m.batch(0)
        try:
            m.loss_of(model(tokens), labels).backward()
            out[how] = ""
        except Exception as err:  # reported: the test asserts which one fails, and how
            out[how] = f"{type(err).__name__}: {err}"
        finally:
            if handle is not None:
                handle.remove()
            swap_pass.reset()
    return out


def run(rank: int, world: int, port: int, out_dir: str, setups: list[str]) -> None:
    """Entry point for ``torch.multiprocessing`` (``rank`` first); ``"tp-classic-compile-layers"``
    in ``setups`` reports :func:`classic_tp_per_block_compile` under that name."""
    init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    refs: dict[str, dict] = {}
    report = {}
    if CLASSIC_TP_COMPILE in setups:
        report[CLASSIC_TP_COMPILE] = classic_tp_per_block_compile(mesh)
        setups = [s for s in setups if s != CLASSIC_TP_COMPILE]

    def train(setup: str, swap: bool) -> dict:
        if setup in PP_COMPILE_SETUPS:  # a pipeline stage per rank
            from tests.eager import pp_worker
            return pp_worker.train_compiled(setup, rank, swap)
        if swap or setup not in MODEL_COMPILE_SETUPS:
            return _train(setup, rank, mesh, swap)
        key = setup.rsplit("-compile-", 1)[0]  # both modes share the plain aot_eager compile
        if key not in refs:
            refs[key] = _train(setup, rank, mesh, swap)
        return refs[key]
    run_setups(rank, out_dir, setups, train, report=report)


def init(rank: int, world: int, port: int) -> None:
    """Join the gloo process group of ``world`` ranks on ``port``, one intra-op thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def shutdown() -> None:
    """Leave the process group: a barrier first, so that no rank tears its gloo connections down
    while a peer still uses them (without it, a rank of the accelerate FSDP2 test aborted at exit,
    "terminate called without an active exception", in 3 of 8 runs; 0 of 15 with it)."""
    dist.barrier()
    dist.destroy_process_group()


def run_setups(rank: int, out_dir: str, setups: list[str], train, *, compare_runs=None,
               report: dict | None = None) -> None:
    """``train(setup, swap)`` without and with swap for each setup; the comparisons
    (``compare_runs(ref, got)``, :func:`compare` by default) or the error go to
    ``out_dir/rank<r>.json`` beside ``report``'s entries; the process group is destroyed at the
    end."""
    compare_runs = compare if compare_runs is None else compare_runs
    report = {} if report is None else report
    try:
        for setup in setups:
            try:
                ref = train(setup, False)
                got = train(setup, True)
                report[setup] = compare_runs(ref, got)
            except Exception:  # reported, so the test names the setup that failed
                report[setup] = {"error": traceback.format_exc()}
                print(report[setup]["error"], file=sys.stderr)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        shutdown()
