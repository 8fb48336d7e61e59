"""Python bytecodes and function calls the eager swap adds per layer: a count, not a timing.

Host CPU time on a shared machine moves by a third from run to run; the number of Python
bytecodes a step executes does not move at all. This traces a few steps of ``HostCostModel``
(tiny checkpointed layers) with ``sys.settrace`` opcode events, plain and with
``enable_swap_layer_input``, and prints what swap adds per layer, in total and per function
(largest first). The C++ side (torch calls) is not counted: read it beside
``scripts/host_cost_phases.py``, which times both.

Usage: PYTHONPATH=<checkout> python scripts/host_cost_bytecodes.py [--layers 32 --steps 2 --top 25]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

import swap_pass
from swap_pass.bench.host_cost import HostCostModel

_Key = tuple[str, str]


def _where(code) -> _Key:
    path = code.co_filename
    for marker in ("site-packages/", "swap_pass/"):
        if marker in path:
            path = path[path.index(marker) + (len(marker) if marker == "site-packages/" else 0):]
            break
    return path, code.co_name


def _count(model: torch.nn.Module, x: torch.Tensor, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """Bytecodes and calls per function over ``steps`` steps (after three untraced ones)."""
    for _ in range(3):
        model(x).backward()
    opcodes: collections.Counter[_Key] = collections.Counter()
    calls: collections.Counter[_Key] = collections.Counter()

    def trace(frame, event, arg):
        if event == "opcode":
            opcodes[_where(frame.f_code)] += 1
        elif event == "call":
            frame.f_trace_opcodes = True
            calls[_where(frame.f_code)] += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(steps):
            model(x).backward()
    finally:
        sys.settrace(None)
    return opcodes, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    torch.set_num_threads(1)
    x = torch.randn(1, 4, 8, requires_grad=True)
    counted = {}
    for name in ("plain", "eager"):
        torch.manual_seed(0)
        model = HostCostModel(args.layers)
        handle = swap_pass.enable_swap_layer_input(model) if name == "eager" else None
        counted[name] = _count(model, x, args.steps)
        if handle is not None:
            handle.remove()
    per_layer = args.steps * args.layers
    (plain_ops, plain_calls), (ops, calls) = counted["plain"], counted["eager"]
    added_ops = {k: (ops[k] - plain_ops[k]) / per_layer for k in ops.keys() | plain_ops.keys()}
    added_calls = {k: (calls[k] - plain_calls[k]) / per_layer for k in calls.keys() | plain_calls.keys()}
    print(f"eager swap adds per layer: {sum(added_ops.values()):.0f} Python bytecodes, "
          f"{sum(added_calls.values()):.1f} Python calls ({args.layers} layers, {args.steps} steps, "
          f"torch {torch.__version__})")
    for key, n in sorted(added_ops.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {n:7.1f} bytecodes {added_calls.get(key, 0):6.2f} calls  {key[0]}:{key[1]}")


if __name__ == "__main__":
    main()
