"""One rank of the Megatron tensor-parallel test: TP=2 + sequence parallel on 2 gloo ranks (CPU).

A tiny ``GPTModel`` (4 layers, local layer spec with :class:`megatron_cpu.SequenceParallelNorm`)
with ``tensor_model_parallel_size=2``, ``sequence_parallel=True`` and full recompute trains
``STEPS`` optimizer steps (torch ``AdamW`` on this rank's shards, after Megatron's all-reduce of
the sequence-parallel norm gradients), once without swap and once with
``swap_pass.integrations.megatron.enable``, for each recompute method in ``SETUPS``. The rank
writes what the test asserts on to ``rank<r>.json``: every loss, every gradient of every step and
every parameter after the last step ``torch.equal``; the swapped layers' inputs (this rank's
sequence shard) off the device at the end of the first forward; bytes released and swapped;
nothing pending; the batch intact; the model really split (weight shards, sequence shards).
"""

from __future__ import annotations

import logging
import warnings

import torch

STEPS, LAYERS, TP = 3, 4, 2
# (recompute_method, recompute_num_layers): uniform, one layer per checkpoint (every layer's
# input kept, every layer swapped); block, the first two layers checkpointed, the rest plain.
SETUPS = {"full-uniform": ("uniform", 1), "full-block": ("block", 2)}
# The swapped layers' forward compiled by swap_pass.compile_layers (aot_eager), against the same
# compile without swap.
COMPILE_SETUPS = {"full-uniform-compile-layers": ("uniform", 1)}
# Under SmartSwap (run_smart): without recompute, and full recompute of every layer.
SMART_SETUPS = {"none": None, "full-uniform": ("uniform", 1)}
SMART_BUDGET = 0.5  # SmartSwap's memory_budget: a fraction of the profiled saved peak


def _build(setup: str):
    from tests.integrations import megatron_cpu as mc
    method, k = {**SETUPS, **COMPILE_SETUPS, **SMART_SETUPS}[setup] or (None, 1)
    cfg = mc.make_config(num_layers=LAYERS, recompute="full" if method else "none",
                         method=method, recompute_layers=k, tensor_model_parallel_size=TP,
                         sequence_parallel=True)
    return mc.make_gpt(cfg, spec=mc.sequence_parallel_spec(cfg))


def _watch(model, layers: list):
    """Pre-hooks keeping each swapped layer's first-forward input, and whether each one's storage
    was freed when the final norm ran (the end of the blocks' forward)."""
    from swap_pass.runtime.freeing import in_backward
    seen: list[torch.Tensor] = []
    freed: list[list[bool]] = []
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, kw: None if in_backward() else seen.append(kw["hidden_states"]),
        with_kwargs=True) for layer in layers]
    hooks.append(model.decoder.final_layernorm.register_forward_pre_hook(
        lambda mod, args: freed.append([x.untyped_storage().nbytes() == 0 for x in seen])))
    return hooks, seen, freed


def _step(model, batch: dict, seed: int) -> torch.Tensor:
    from tests.integrations import megatron_cpu as mc
    torch.manual_seed(seed)
    mc.tensor_parallel_seed(seed)
    loss = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                 labels=batch["labels"]).mean()
    loss.backward()
    mc.allreduce_sequence_parallel_grads(model)
    return loss.detach()


def _train(setup: str, swap: bool) -> dict:
    import swap_pass
    from swap_pass.integrations import megatron as sp_megatron
    from swap_pass.integrations.megatron import layers_to_swap
    from tests.distributed.dist_worker import _graphs, close_record
    from tests.integrations import megatron_cpu as mc
    swap_pass.reset()
    model = _build(setup)
    if setup in COMPILE_SETUPS:
        from torch import _dynamo
        _dynamo.reset()
        _dynamo.utils.counters.clear()  # graphs and breaks of this compile alone
        handle = swap_pass.compile_layers(model.decoder, layers=layers_to_swap(model.decoder),
                                          backend="aot_eager", swap=swap).swap
    else:
        handle = sp_megatron.enable(model) if swap else None
    hooks, seen, freed = _watch(model, layers_to_swap(model.decoder))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec: dict = {"losses": [], "grads": [], "outs": [], "intact": True, "clean": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            batch = mc.make_batch(seed=step)  # the same batch on both TP ranks
            kept = {k: v.clone() for k, v in batch.items()}
            opt.zero_grad(set_to_none=True)
            rec["losses"].append(_step(model, batch, seed=7 + step))
            rec["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            stats = swap_pass.swap_stats()
            rec["outs"].append(stats.swap_outs)
            rec["intact"] &= all(torch.equal(batch[k], kept[k]) for k in batch)
            pending = sum(len(m.batch_stack) for m in handle.managers) if handle else 0
            rec["clean"] &= pending == 0 and stats.host_bytes_in_use == 0
    for hook in hooks:
        hook.remove()
    return close_record(
        rec, caught, handle, params={n: p.detach().clone() for n, p in model.named_parameters()},
        freed=freed[0], input_shape=list(seen[0].shape),
        qkv_shape=list(model.decoder.layers[0].self_attention.linear_qkv.weight.shape),
        final_norm=model.decoder.final_layernorm.weight.tolist(),
        compiled=_graphs(None) if setup in COMPILE_SETUPS else None)


def _compare(ref: dict, got: dict) -> dict:
    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    return {
        "losses_equal": all(torch.equal(a, b)
                            for a, b in zip(ref["losses"], got["losses"], strict=True)),
        "grads_equal": all(same(a, b) for a, b in zip(ref["grads"], got["grads"], strict=True)),
        "params_equal": same(ref["params"], got["params"]),
        "n_params": len(got["params"]), "ref_outs": ref["outs"][-1],
        "losses": [float(x) for x in got["losses"]],
        **{k: got[k] for k in ("outs", "freed", "input_shape", "qkv_shape", "final_norm",
                                "released", "swapped_in", "skipped", "clean", "warnings",
                                "compiled")},
        "intact": got["intact"] and ref["intact"],
    }


def smart_setup(setup: str, rank: int, mesh) -> tuple:
    """``tests.smart.dist_worker``'s ``(model, batch, None, forward_backward)`` for ``setup`` of
    :data:`SMART_SETUPS` (``mesh`` unused: Megatron's groups are its own); both TP ranks share
    the batch; a step is :func:`_step` (seeded, the sequence-parallel norm gradients summed)."""
    from megatron.core import parallel_state

    from tests.integrations import megatron_cpu as mc
    if not parallel_state.model_parallel_is_initialized():
        mc.init_parallel(tp=TP)
    model = _build(setup)
    keys = ("input_ids", "position_ids", "attention_mask", "labels")
    steps = iter(range(10**6))

    def forward_backward(batch, counter, smart, out: dict) -> list[torch.Tensor]:
        return [_step(model, dict(zip(keys, batch, strict=True)), seed=7 + next(steps))]
    return model, lambda step: tuple(mc.make_batch(seed=step)[k] for k in keys), None, \
        forward_backward


def run_smart(rank: int, world: int, port: int, out_dir: str, setups: list[str]) -> None:
    """Entry point for ``torch.multiprocessing``: ``setups`` (of :data:`SMART_SETUPS`) without
    and with ``SmartSwap``, by ``tests.smart.dist_worker``."""
    from tests.integrations import megatron_cpu as mc
    from tests.smart import dist_worker
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    with mc.cpu_shims():
        dist_worker.run(rank, world, port, out_dir, setups, smart_setup, SMART_BUDGET)


def run(rank: int, world: int, port: int, out_dir: str, setups: list[str]) -> None:
    """Entry point for ``torch.multiprocessing`` (``rank`` first)."""
    from tests.distributed.dist_worker import init, run_setups
    from tests.integrations import megatron_cpu as mc
    warnings.simplefilter("ignore")
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    init(rank, world, port)
    with mc.cpu_shims():
        mc.init_parallel(tp=TP)
        run_setups(rank, out_dir, setups, _train, compare_runs=_compare)
