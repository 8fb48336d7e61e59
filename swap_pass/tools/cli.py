"""The ``swap-pass`` command line: ``demo``, ``bench``, ``plan``, ``capacity`` (also
``python -m swap_pass``)."""


from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

import torch

__all__ = ["build_parser", "main"]

_DESCRIPTION = ("swap_pass command line: demo (a small model trained with and without swap), "
                "bench (methods side by side), plan (bytes and copy-vs-compute estimates; with "
                "--device-memory the largest size per method), capacity (the largest batch, "
                "sequence or hidden size each method trains under a device-memory cap, measured). "
                "Also runs as: python -m swap_pass.")


def _device(name: str | None) -> torch.device:
    from swap_pass.runtime.device import accelerator_type

    if name is not None and name.split(":")[0] == "swaptest":  # the test accelerator
        from swap_pass.testing import load_test_accelerator

        load_test_accelerator()
    return torch.device(name or accelerator_type())


def _add_sizes(p: argparse.ArgumentParser, bench: bool) -> None:
    from swap_pass.tools.bench.presets import get_preset
    from swap_pass.tools.demo import DEMO_PRESET

    base = get_preset("tiny") if bench else DEMO_PRESET

    def default(value: int) -> str:
        return f"(default: the preset's; {value} for tiny)" if bench else f"(default: {value})"

    p.add_argument("--hidden", type=int, help="hidden size " + default(base.model.hidden_size))
    p.add_argument("--layers", type=int, help="number of layers " + default(base.model.num_layers))
    p.add_argument("--seq", type=int, help="sequence length " + default(base.seq))
    p.add_argument("--batch", type=int, help="micro-batch size " + default(base.batch))
    p.add_argument("--device",
                   help="cpu, cuda, npu... or swaptest (the CPU-backed test accelerator of "
                        "swap_pass.testing: its times mean nothing) (default: the accelerator if "
                        "one is present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed (default: 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op CPU threads while measuring, fixed so runs compare (default: 1)")


def _add_demo(sub) -> None:
    from swap_pass.tools.demo import DEFAULT_STEPS

    p = sub.add_parser("demo", help="train a small Llama-style model with and without swap",
                       description="Train a small Llama-style model with no swap, full "
                       "recompute and recompute + swap; print peak memory, step time and whether "
                       "the losses match no swap bitwise.")
    _add_sizes(p, bench=False)
    p.add_argument("--steps", type=int,
                   help="training steps per row, at least 3: 1 warm-up, the rest timed but the "
                   f"last, which is profiled (default: {DEFAULT_STEPS})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_bench(sub) -> None:
    from swap_pass.tools.bench.methods import METHODS
    from swap_pass.tools.bench.presets import PRESETS, get_preset

    p = sub.add_parser("bench", help="compare swap methods and peers on one model, seed and data",
                       description="Every method side by side on one model, seed and data: memory, "
                       "wall and CPU time, losses against the reference, copy bandwidth.")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model and schedule (default: tiny on CPU and the test accelerator, "
                   "llama-8b-layer on an accelerator)")
    _add_sizes(p, bench=True)
    p.add_argument("--methods",
                   help="comma list of " + ",".join(m.key for m in METHODS) + " (default: all)")
    tiny = get_preset("tiny")
    p.add_argument("--steps", type=int,
                   help=f"timed steps (default: the preset's; {tiny.timed_steps} for tiny)")
    p.add_argument("--warmup", type=int,
                   help=f"warm-up steps (default: the preset's; {tiny.warmup_steps} for tiny)")
    p.add_argument("--compile-inner", help="inner compiler of the compile rows "
                   "(default: inductor on an accelerator, aot_eager on CPU)")
    p.add_argument("--smart-budget", type=float, default=0.25,
                   help="SmartSwap budget as a fraction of the no-swap peak (default: 0.25)")
    p.add_argument("--no-smart-rows", action="store_true",
                   help="skip SmartSwap's own rows (profiler overhead, budget, varying lengths: "
                   "about a quarter of the bench's time on CPU)")
    p.add_argument("--no-host-rows", action="store_true",
                   help="skip the host CPU time per layer rows (a few seconds)")
    p.add_argument("--no-window-rows", action="store_true",
                   help="on the test accelerator (--device swaptest), skip the copy windows per "
                   "way in (about a minute)")
    p.add_argument("--megatron", action="store_true",
                   help="also a megatron-core GPTModel: swap_pass vs Megatron's fine-grained "
                   "offloading vs full recompute vs none (needs megatron-core and CUDA)")
    p.add_argument("--json", metavar="PATH",
                   help="write the full report as JSON, and the memory plot beside it "
                   "(PATH with .png)")
    p.add_argument("--plot", metavar="PATH",
                   help="draw memory over one step per method to PATH (PNG)")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="bytes swapped, host memory needed, and whether copies hide "
                       "behind compute")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--batch", type=int, default=1, help="micro-batch size (default: 1)")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16, fp32, fp8 (default: bf16)")
    p.add_argument("--bandwidth", type=float, default=25.0, help="host<->device GB/s (default: 25)")
    p.add_argument("--tflops", type=float, default=300.0, help="achieved TFLOP/s (default: 300)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches in flight, PP (default: 1)")
    p.add_argument("--no-recompute", action="store_true",
                   help="layers are not recomputed in backward")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON ('-' for stdout)")
    p.add_argument("--device-memory", help="also plan the largest size per method under this "
                   "much device memory (bytes, or with a unit: 64GiB, 80GB)")
    p.add_argument("--dim", choices=["batch", "seq", "hidden"], default="batch",
                   help="size planned with --device-memory (default: batch)")
    p.add_argument("--heads", type=int, help="attention heads (default: hidden / 128)")
    p.add_argument("--intermediate", type=int,
                   help="MLP width (default: 3.5 x hidden, as Llama-3-8B)")
    p.add_argument("--vocab", type=int, default=128256,
                   help="vocabulary size (default: 128256, Llama 3)")
    p.add_argument("--optimizer", default="sgd", help="sgd, sgd-momentum, adam (states in the "
                   "parameter dtype), adam-mixed (fp32 master weights and states) (default: sgd)")
    p.add_argument("--host-memory", help="host memory the swapping methods may use (default: "
                   "what this machine has available now)")


def _add_capacity(sub) -> None:
    from swap_pass.tools.bench.presets import PRESETS

    p = sub.add_parser("capacity",
                       help="largest batch/seq/hidden each method trains under a device-memory cap",
                       description="For each method, search (exponential steps from the planner's "
                       "answer, then binary) the largest size whose training step runs within the "
                       "cap, and print its peak, the planner's peak, step and CPU time, and "
                       "whether its losses equal no swap's. On CPU the cap is virtual (measured "
                       "peaks compared with it); on an accelerator it is enforced by the "
                       "allocator.")
    p.add_argument("--device-memory", help="the cap: bytes, or with a unit (64MiB, 80GiB) "
                   "(default: the device's total memory)")
    p.add_argument("--dim", choices=["batch", "seq", "hidden"], default="batch",
                   help="size searched (default: batch)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model and schedule (default: tiny on CPU and the test accelerator, "
                   "llama-8b-layer on an accelerator)")
    _add_sizes(p, bench=True)
    p.add_argument("--methods", help="comma list of bench methods "
                   "(default: no_swap,recompute,eager_swap,smartswap)")
    p.add_argument("--max-host-bytes", help="host memory the swapping methods may hold "
                   "(default: what the machine has available now)")
    p.add_argument("--search-max", type=int, default=1 << 16,
                   help="largest size tried, in units of --dim (hidden: 2 x heads) "
                   "(default: 65536)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-' for stdout)")


def build_parser() -> argparse.ArgumentParser:
    """The ``swap-pass`` argument parser."""
    parser = argparse.ArgumentParser(prog="swap-pass", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_capacity(sub)
    return parser


def _sizes(args: argparse.Namespace) -> dict:
    out = {"hidden_size": args.hidden, "num_layers": args.layers, "seq": args.seq,
           "batch": args.batch}
    return {k: v for k, v in out.items() if v is not None}


def _run_demo(args: argparse.Namespace) -> int:
    from swap_pass.tools.demo import demo_preset, format_demo, run_demo

    device = _device(args.device)
    preset = demo_preset(hidden=args.hidden, layers=args.layers, seq=args.seq, batch=args.batch,
                         steps=args.steps)
    report = run_demo(preset, device, seed=args.seed, progress=not args.no_progress,
                      threads=args.threads)
    rows = report.rows
    print(format_demo(report, preset, device))
    return 1 if any(r.status == "failed" or r.losses_match is False for r in rows) else 0


def _bench_preset(args: argparse.Namespace, device: torch.device):
    from swap_pass.tools.bench.presets import get_preset

    preset = get_preset(args.preset or ("tiny" if device.type in ("cpu", "swaptest")
                                      else "llama-8b-layer"))
    changes = _sizes(args)
    if args.seq is not None:
        changes["max_seq_len"] = max(args.seq, preset.model.max_seq_len)
    if getattr(args, "steps", None) is not None:
        changes["timed_steps"] = args.steps
    if getattr(args, "warmup", None) is not None:
        changes["warmup_steps"] = args.warmup
    return preset.resized(**changes)


def _run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from swap_pass.tools.bench import (
        BenchContext,
        default_compile_inner,
        format_report,
        plot_memory,
        run_bench,
        write_json,
    )

    device = _device(args.device)
    preset = _bench_preset(args, device)
    ctx = BenchContext(device, args.compile_inner or default_compile_inner())
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    report = run_bench(preset, ctx, methods=methods, seed=args.seed,
                       smart_budget_fraction=args.smart_budget,
                       command=shlex.join(["swap-pass", *argv]), smart_rows=not args.no_smart_rows,
                       host_rows=not args.no_host_rows, threads=args.threads,
                       progress=lambda label: print(f"... {label}", file=sys.stderr, flush=True))
    print(format_report(report))
    for line in _planned_rates():
        print(line)
    if device.type == "swaptest" and not args.no_window_rows:
        from swap_pass.tools.bench.windows import format_windows, measure_windows

        rows = measure_windows(device)
        report.extra["copy_windows"] = [dataclasses.asdict(r) for r in rows]
        print(format_windows(rows))
    if not args.json and not args.plot:
        print("(--json PATH writes this report as JSON, with the memory plot beside it; "
              "--plot PATH writes the plot alone)")
    if args.megatron:
        from swap_pass.tools.bench.megatron import format_megatron, megatron_section
        report.extra["megatron"] = megatron_section(device)
        print("\n".join(format_megatron(report.extra["megatron"])))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    for path in _plot_paths(args):
        plot_memory(report, path)
        print(f"wrote {path}")
    megatron_rows = report.extra.get("megatron", {}).get("rows", [])
    return 1 if any(r.status == "failed" or r.losses_match is False for r in report.rows) or any(
        r["status"] != "ok" or r.get("exact") is False for r in megatron_rows
        if r["method"] != "megatron_offload") else 0


def _plot_paths(args: argparse.Namespace) -> list[str]:
    """--plot PATH, and the plot beside --json when matplotlib is installed."""
    from swap_pass.tools.bench.report import plot_path

    paths = [args.plot] if args.plot else []
    if args.json and plot_path(args.json) not in paths:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("no plot beside the JSON: matplotlib is not installed", file=sys.stderr)
        else:
            paths.append(plot_path(args.json))
    return paths


def _run_plan(args: argparse.Namespace) -> int:
    from swap_pass.tools.plan import PlanInputs, format_plan, simulate

    inputs = PlanInputs(hidden=args.hidden, seq=args.seq, layers=args.layers, batch=args.batch,
                        dtype=args.dtype, bandwidth_gbs=args.bandwidth, tflops=args.tflops,
                        micro_batches=args.micro_batches, recompute=not args.no_recompute)
    result = simulate(inputs)
    print(format_plan(inputs, result))
    if args.device_memory:
        print(_plan_capacity(args))
    if args.json:
        data = {"inputs": dataclasses.asdict(inputs),
                "result": {**dataclasses.asdict(result), "hides": result.hides}}
        text = json.dumps(data, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


def _plan_capacity(args: argparse.Namespace) -> str:
    from swap_pass.tools.bench.presets import BenchPreset
    from swap_pass.tools.capacity.limits import available_host_bytes, parse_bytes
    from swap_pass.tools.capacity.planned import plan_capacity
    from swap_pass.tools.capacity.report import format_planned
    from swap_pass.tools.memory_model import TRAINING_DTYPES
    from swap_pass.tools.models import LlamaConfig

    if args.dtype not in TRAINING_DTYPES:
        raise ValueError(f"swap_pass.tools.plan: dtype={args.dtype!r} has no memory model. "
                         "It must be fp32, bf16 or fp16 with --device-memory.")
    heads = args.heads or max(1, args.hidden // 128)
    model = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                        num_heads=heads,
                        intermediate_size=args.intermediate or int(3.5 * args.hidden),
                        max_seq_len=args.seq)
    preset = BenchPreset("plan", model, batch=args.batch, seq=args.seq, dtype=args.dtype)
    cap = parse_bytes(args.device_memory)
    host = parse_bytes(args.host_memory) if args.host_memory else available_host_bytes()
    host_source = ("--host-memory" if args.host_memory else
                   "this machine's available memory; pass --host-memory for the training host's")
    rows = plan_capacity(preset, args.dim, cap, host, optimizer=args.optimizer,
                         micro_batches=args.micro_batches)
    what = (f"hidden={args.hidden} layers={args.layers} heads={heads} "
            f"intermediate={model.intermediate_size} "
            f"vocab={args.vocab} seq={args.seq} batch={args.batch} dtype={args.dtype} "
            f"optimizer={args.optimizer} micro_batches={args.micro_batches}")
    return format_planned(rows, cap, host, args.dim, what, host_source)


def _run_capacity(args: argparse.Namespace, argv: list[str]) -> int:
    from swap_pass.tools.bench import default_compile_inner
    from swap_pass.tools.capacity.limits import device_total_bytes, parse_bytes
    from swap_pass.tools.capacity.measured import run_capacity
    from swap_pass.tools.capacity.report import format_capacity, write_capacity_json

    device = _device(args.device)
    preset = _bench_preset(args, device)
    cap = parse_bytes(args.device_memory) if args.device_memory else device_total_bytes(device)
    host = parse_bytes(args.max_host_bytes) if args.max_host_bytes else None
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    report = run_capacity(preset, device, cap, dim=args.dim, methods=methods, host_limit_bytes=host,
                          seed=args.seed, threads=args.threads, limit=args.search_max,
                          compile_inner=default_compile_inner(),
                          command=shlex.join(["swap-pass", *argv]),
                          progress=lambda line: print(f"... {line}", file=sys.stderr, flush=True))
    print(format_capacity(report))
    if args.json:
        write_capacity_json(report, args.json)
        if args.json != "-":
            print(f"wrote {args.json}")
    return 1 if any(r.exact is False for r in report.rows) else 0


def main(argv: list[str] | None = None) -> int:
    """Run ``swap-pass`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Exit status 1 from ``demo`` and ``bench``: a row failed or its losses differ from its reference;
    from ``capacity``: a method's losses differ from its reference.
    Exit status 2: bad arguments.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _run_demo(args)
        if args.command == "bench":
            return _run_bench(args, argv)
        if args.command == "capacity":
            return _run_capacity(args, argv)
        return _run_plan(args)
    except ValueError as err:
        print(f"swap-pass {args.command}: {err}", file=sys.stderr)
        return 2


def _planned_rates() -> list[str]:
    """The rates budget mode planned with in this run (measured once per device and dtype),
    one line each; none where no row used budget mode."""
    from swap_pass.cost.probes import measured_rates

    lines = []
    for (what, device, dtype, threads), rate in sorted(measured_rates().items(), key=str):
        where = f"{device}" + (f", {threads} CPU threads" if threads else "")
        if what == "copy":
            lines.append(f"budget mode planned with: device-to-host copy {rate / 1e9:.2f} GB/s "
                         f"({where})")
        else:
            dtype_name = str(dtype).removeprefix("torch.")
            lines.append(f"budget mode planned with: {dtype_name} matmul "
                         f"{rate / 1e12:.3f} TFLOP/s ({where})")
    return lines
