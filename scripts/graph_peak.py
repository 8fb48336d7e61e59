"""Whole-step peak of HF Llama under torch.compile, with and without swap_backend.

Rows: budget mode without checkpointing vs the same compile without swap, and layer-input mode
with checkpointing vs the same compile without swap. Peak: one profiled step after a warm-up step
(torch.profiler memory events on CPU, max_memory_allocated on an accelerator); the warm-up fills
the host pool, so the profiled step allocates no host buffer (checked). Gradients are compared
bitwise, with torch.use_deterministic_algorithms(True) (``--no-deterministic`` turns it off):
without it Inductor's CPU code for the embedding's backward adds into the weight gradient with
atomic adds from several threads, so even the compile without swap differs from run to run.

``--json PATH`` writes the rows with the command, date and build (``scripts/results_page.py``
makes ``docs/results.md``'s table from it).

Usage: python scripts/graph_peak.py [--layers 4 --hidden 64 --batch 8 --seq 512 --inner inductor
                                     --budget 0.5 --rows budget,layer_input --json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

import torch

import swap_pass
from swap_pass import make_swap_backend
from swap_pass.tools.bench.hf_llama_peak import hf_llama_step_peak


def _run(args, backend, checkpoint: bool):
    return hf_llama_step_peak(backend, checkpoint=checkpoint, layers=args.layers,
                              hidden=args.hidden, batch=args.batch, seq=args.seq,
                              vocab=args.vocab, device=args.device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = (("layers", 4), ("hidden", 64), ("batch", 8), ("seq", 512), ("vocab", 128))
    for name, default in sizes:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--inner", default="inductor")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default="budget,layer_input", help="budget, layer_input or both")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.use_deterministic_algorithms while compiling and running")
    p.add_argument("--json", help="also write the rows, command and build to this file")
    args = p.parse_args()
    torch.use_deterministic_algorithms(args.deterministic)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # compile afresh: a cache hit would skip the partitioner (and the choice this prints)
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    x_bytes = args.batch * args.seq * args.hidden * 4
    rows = {"budget": ("budget, no checkpointing", dict(memory_budget=args.budget), False),
            "layer_input": ("layer inputs, checkpointing", {}, True)}
    meta = _meta(args)  # the build and date as the measuring starts
    found = [_row(args, rows[key], x_bytes) for key in args.rows.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            meta["load_avg_1m"].append(round(os.getloadavg()[0], 2))
            json.dump({"rows": found, "meta": meta}, f, indent=2)


def _row(args, row, x_bytes: int) -> dict:
    label, options, checkpoint = row
    backend = make_swap_backend(args.inner, **options)
    t0 = time.time()
    peak, grads = _run(args, backend, checkpoint)
    released = swap_pass.swap_stats().peak_device_bytes_released  # since the run's reset
    ref_peak, ref_grads = _run(args, args.inner, checkpoint)
    equal = all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(grads, ref_grads, strict=True))
    print(f"{label}: peak {ref_peak / 2**20:.2f} -> {peak / 2**20:.2f} MiB "
          f"(x{peak / ref_peak:.3f}, cut {(ref_peak - peak) / 2**20:.2f} MiB = "
          f"{(ref_peak - peak) / x_bytes:.2f} layer inputs of {args.layers}); "
          f"swap_stats().peak_device_bytes_released {released / 2**20:.2f} MiB; "
          f"grads bitwise equal: {equal} (max relative difference {diff:.1e}); "
          f"{time.time() - t0:.0f} s")
    summary = backend.partitions[-1].summary().splitlines()[0]
    print("  " + summary)
    return {"row": label, "options": {k: v for k, v in options.items()},
            "checkpoint": checkpoint, "peak_bytes": peak, "reference_peak_bytes": ref_peak,
            "cut_layer_inputs": (ref_peak - peak) / x_bytes,
            "peak_device_bytes_released": released, "bitwise": equal,
            "max_relative_difference": diff, "partition": summary}


def _meta(args) -> dict:
    from swap_pass.tools.bench.run import describe_machine, source_build

    return {"command": shlex.join(["python", "scripts/graph_peak.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": describe_machine(torch.device(args.device)),
            "torch": torch.__version__, "build": source_build(), "layers": args.layers,
            "hidden": args.hidden, "batch": args.batch, "seq": args.seq, "inner": args.inner,
            "load_avg_1m": [round(os.getloadavg()[0], 2)]}


if __name__ == "__main__":
    main()
