"""One rank of the Megatron pipeline test, started by torchrun (gloo, CPU).

``python -m torch.distributed.run --nproc-per-node N megatron_pp_worker.py OUT SCHEDULE``:
Megatron's own ``get_forward_backward_func()`` runs 1F1B (``SCHEDULE=1f1b``, 2 stages, N=2), the
interleaved schedule (``interleaved``, 2 virtual stages per rank, N=2), or either with tensor
parallel 2 and sequence parallel (``1f1b-tp2``, ``interleaved-tp2``, N=4; the sequence-parallel
norms of ``megatron_cpu.sequence_parallel_spec``) with full recompute, once
without swap and once with ``swap_pass.integrations.megatron.enable`` on the model chunks. The
rank writes what the test asserts on (bitwise equality, swaps done, nothing pending) to
``OUT/rank{R}.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from swap_pass.tools.bench.megatron import forward_step  # noqa: E402
from tests.integrations import megatron_cpu as mc  # noqa: E402

MICROBATCHES, LAYERS = 4, 8


# schedule -> (virtual stages per rank, tensor-parallel size); TP runs with sequence parallel.
SCHEDULES = {"1f1b": (None, 1), "interleaved": (2, 1), "1f1b-tp2": (None, 2),
             "interleaved-tp2": (2, 2)}


def _chunks(vp: int | None, tp: int) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps

    extra = dict(tensor_model_parallel_size=tp, sequence_parallel=True) if tp > 1 else {}
    cfg = mc.make_config(num_layers=LAYERS, recompute="full", method="uniform",
                         recompute_layers=1, pp=2, vp=vp, batch_p2p_comm=False, **extra)
    spec = mc.sequence_parallel_spec(cfg) if tp > 1 else None
    stages = range(vp) if vp else [None]
    return [mc.make_gpt(cfg,
                        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                        vp_stage=v, spec=spec) for v in stages]


def _run(chunks, swap: bool) -> dict:
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import swap_pass
    from swap_pass.integrations import megatron as sp_megatron

    swap_pass.reset()
    handle = sp_megatron.enable(chunks) if swap else None
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    batches = [mc.make_batch(seed=i) for i in range(MICROBATCHES)]
    kept = [{k: v.clone() for k, v in b.items()} for b in batches]
    iters = [iter(batches) for _ in chunks]
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=MICROBATCHES,
        seq_length=mc.SEQ, micro_batch_size=2, forward_only=False)
    stats = swap_pass.swap_stats()
    pending = sum(len(m.batch_stack) for m in handle.managers) if handle else 0
    result = {"losses": [out["loss"] for out in losses],
              "grads": {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks)
                        for n, p in c.named_parameters() if p.grad is not None},
              "swap_outs": stats.swap_outs, "swap_ins": stats.swap_ins,
              "released": stats.peak_device_bytes_released, "pending": pending,
              "host_in_use": stats.host_bytes_in_use,
              "batches_intact": all(torch.equal(b[k], c[k])
                                    for b, c in zip(batches, kept, strict=True) for k in b)}
    if handle:
        handle.remove()
    return result


def main(out: str, schedule: str) -> None:
    warnings.simplefilter("ignore")
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    rank = int(os.environ["RANK"])
    with mc.cpu_shims():
        vp, tp = SCHEDULES[schedule]
        mc.init_parallel(pp=2, vp=vp, tp=tp)
        ref = _run(_chunks(vp, tp), swap=False)
        got = _run(_chunks(vp, tp), swap=True)
    report = {
        "losses_equal": len(ref["losses"]) == len(got["losses"]) and all(
            torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"], strict=True)),
        "grads_equal": ref["grads"].keys() == got["grads"].keys() and all(
            torch.equal(ref["grads"][n], got["grads"][n]) for n in ref["grads"]),
        "n_grads": len(got["grads"]),
        **{k: got[k] for k in ("swap_outs", "swap_ins", "released", "pending", "host_in_use",
                                "batches_intact")},
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
