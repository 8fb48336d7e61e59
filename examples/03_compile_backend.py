"""``torch.compile(model, backend=...)`` with swap nodes in the compiled graphs.

After AOTAutograd partitions forward and backward, each saved layer-boundary activation becomes
a ``torch.ops.swap_pass`` swap-out in the forward graph and a prefetch plus swap-in in the
backward graph. Compared with the same compile without swap. On CPU the inner compiler is
``aot_eager`` (inductor's C++ build takes minutes on 2 cores); pass ``--inner inductor`` to use it::

    python examples/03_compile_backend.py [--inner inductor]
"""

from __future__ import annotations

import argparse

import torch

import swap_pass
from swap_pass import make_swap_backend
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

CFG = LlamaConfig(hidden_size=64, num_layers=4, num_heads=4, intermediate_size=176)


def train(backend, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = LlamaStyleModel(CFG, recompute=True)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        loss = compiled(*make_batch(CFG, 2, 128, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner", default="aot_eager", help="aot_eager (default) or inductor")
    args = parser.parse_args()
    swap_pass.reset()
    expected = train(args.inner)
    got = train(make_swap_backend(inner=args.inner))
    stats = swap_pass.swap_stats()
    # aot_eager runs the same ATen ops either way: losses must be bitwise equal. Inductor may
    # fuse differently around the swap nodes, so it is compared within a tolerance.
    same = all(torch.equal(a, b) if args.inner == "aot_eager"
               else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
               for a, b in zip(expected, got, strict=True))
    assert same, (expected, got)
    assert stats.swap_outs > 0 and stats.host_bytes_in_use == 0, stats
    print(f"inner={args.inner}; swap-outs: {stats.swap_outs}; bytes out: {stats.swapped_out_bytes}")
    print("OK: compiled losses with swap match the same compile without swap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
