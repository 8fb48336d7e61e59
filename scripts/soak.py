"""Soak test: train the tiny model for many steps with swap, next to a no-swap twin.

At every step the script checks that

* the swap really happened: between forward and backward the runtime reports exactly the
  layer inputs of all layers but the last as freed on the device (``device_bytes_released``);
* the loss and every gradient are bitwise equal (``torch.equal``) to the twin's;
* after the step no host byte is in use and no group is pending in any manager;

and at the end that the process's resident memory (``VmRSS`` in ``/proc/self/status``) grew by
less than ``--max-rss-growth`` from step ``--rss-from`` to the last step. It stops at the first
violation, prints a summary, and exits 1 on any violation, 0 otherwise.

Usage::

    python3 scripts/soak.py                       # 2,000 steps, plain layers, CPU
    python3 scripts/soak.py --recompute --steps 500
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import swap_pass  # noqa: E402
from swap_pass.runtime.chain import SwapLayerInputManager  # noqa: E402
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch  # noqa: E402


class SoakViolation(AssertionError):
    """A check of the soak failed; the message names the step and what differed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="training steps (default: 2000)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    p.add_argument("--recompute", action="store_true", help="checkpoint every layer")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--rss-from", type=int, default=100,
                   help="step whose RSS is the baseline of the growth check (default: 100)")
    p.add_argument("--max-rss-growth", type=float, default=0.05,
                   help="largest allowed RSS growth as a fraction (default: 0.05)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; more than the free cores slows steps tenfold "
                        "(default: 1)")
    p.add_argument("--log-every", type=int, default=200, help="progress line period (default: 200)")
    p.add_argument("--negative-control", action="store_true",
                   help="double one weight of the no-swap twin: the bitwise check must fire")
    args = p.parse_args(argv)
    if not 0 <= args.rss_from < args.steps:
        p.error(f"--rss-from={args.rss_from} must be in [0, --steps={args.steps})")
    return args


def rss_bytes() -> int | None:
    """Resident set size of this process from ``/proc/self/status``; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build(args: argparse.Namespace):
    """The no-swap reference, the swapped twin (same weights), their optimizers and the handle."""
    cfg = LlamaConfig(num_layers=args.layers)
    torch.manual_seed(0)
    ref = LlamaStyleModel(cfg, recompute=args.recompute).to(args.device)
    model = copy.deepcopy(ref)
    if args.negative_control:
        with torch.no_grad():
            ref.lm_head.weight.view(-1)[0] *= 2
    handle = swap_pass.enable_swap_layer_input(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    return cfg, (ref, model), opts, handle


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def run_step(model, opt, batch, after_forward=None):
    """Forward, backward, optimizer step; ``after_forward()`` runs between forward and backward."""
    opt.zero_grad(set_to_none=True)
    loss = model(*batch)
    if after_forward is not None:
        after_forward()
    loss.backward()
    result = (loss.detach(), {n: g.clone() for n, g in grads(model).items()})
    opt.step()
    return result


def check_freed(step: int, expected: int) -> None:
    """The swap freed exactly the layer inputs it should have, before backward."""
    released = swap_pass.swap_stats().device_bytes_released
    if released != expected:
        raise SoakViolation(f"step {step}: {released} device bytes freed after forward, "
                            f"{expected} expected (every layer input but the last)")


def check_exact(step: int, ref, got) -> None:
    """Loss and every gradient bitwise equal to the no-swap twin's."""
    if not torch.equal(ref[0], got[0]):
        raise SoakViolation(f"step {step}: loss {got[0].item()!r} != no-swap {ref[0].item()!r}")
    for name, g in ref[1].items():
        if not torch.equal(g, got[1][name]):
            raise SoakViolation(f"step {step}: gradient of {name} differs from no swap")


def check_clean(step: int) -> None:
    """Nothing left behind by the step: no host byte in use, no pending group."""
    in_use = swap_pass.swap_stats().host_bytes_in_use
    managers = SwapLayerInputManager.manager_map.values()
    pending = sum(len(m.batch_stack) for ms in managers for m in ms)
    if in_use or pending:
        raise SoakViolation(f"step {step}: {in_use} host bytes in use, {pending} groups pending "
                            "after the step (both must be 0)")


def check_rss(start: int | None, end: int | None, limit: float) -> float | None:
    """RSS growth as a fraction of ``start``; raises past ``limit``. None when RSS is unknown."""
    if start is None or end is None:
        return None
    growth = (end - start) / start
    if growth >= limit:
        raise SoakViolation(f"RSS grew {growth:.2%} ({start} -> {end} bytes), limit {limit:.0%}")
    return growth


def soak(args: argparse.Namespace, log=print) -> dict[str, object]:
    """Run the soak; returns the summary. Raises :class:`SoakViolation` at the first failure."""
    cfg, (ref, model), (ref_opt, opt), handle = build(args)
    try:
        return _train(args, cfg, ref, model, ref_opt, opt, log)
    finally:
        handle.remove()


def _train(args, cfg, ref, model, ref_opt, opt, log) -> dict[str, object]:
    per_input = args.batch * args.seq * cfg.hidden_size * ref.embed.weight.element_size()
    expected_freed = (cfg.num_layers - 1) * per_input
    summary: dict[str, object] = {"steps_done": 0, "rss_start": None, "rss_end": None}
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = make_batch(cfg, args.batch, args.seq, seed=step, device=args.device)
        expected = run_step(ref, ref_opt, batch)
        got = run_step(model, opt, batch, lambda step=step: check_freed(step, expected_freed))
        check_exact(step, expected, got)
        check_clean(step)
        summary["steps_done"] = step + 1
        if step == args.rss_from:
            summary["rss_start"] = rss_bytes()
        if args.log_every and (step + 1) % args.log_every == 0:
            log(f"step {step + 1}/{args.steps}: loss {got[0].item():.6f}, rss {rss_bytes()} B, "
                f"{time.perf_counter() - t0:.1f} s")
    summary["rss_end"] = rss_bytes()
    summary["rss_growth"] = check_rss(summary["rss_start"], summary["rss_end"], args.max_rss_growth)
    summary["seconds"] = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 when every check held at every step, 1 at the first violation."""
    args = parse_args(argv)
    print(f"soak: {args.steps} steps, batch ({args.batch}, {args.seq}), {args.layers} layers, "
          f"recompute={args.recompute}, device={args.device}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        summary = soak(args)
    except SoakViolation as err:
        print(f"soak: FAILED: {err}")
        return 1
    finally:
        torch.set_num_threads(threads)  # main() may run inside a test process
    growth = summary["rss_growth"]
    stats = swap_pass.swap_stats()
    print(f"soak: OK: {summary['steps_done']} steps in {summary['seconds']:.1f} s; losses and "
          f"gradients bitwise equal to no swap at every step; 0 host bytes in use after each step; "
          f"swap_outs={stats.swap_outs} swap_ins={stats.swap_ins} "
          f"host_allocations={stats.host_allocations}; RSS {summary['rss_start']} -> "
          f"{summary['rss_end']} B from step {args.rss_from} "
          f"({'unknown' if growth is None else f'{growth:+.2%}'}, limit {args.max_rss_growth:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
