"""SmartSwap: choose which saved tensors to swap, under a memory budget, for any model.

SmartSwap profiles a step, plans (``warmup`` -> ``gen_policy`` -> ``stable``) and then swaps the
tensors its policy picked through the same runtime. Call ``smart.step()`` after each optimizer
step; when the sequence of saved tensors changes (e.g. another sequence length) it plans again::

    python examples/05_smartswap.py
"""

from __future__ import annotations

import copy

import torch

import swap_pass
from swap_pass import SmartSwap
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

CFG = LlamaConfig(hidden_size=64, num_layers=4, num_heads=4, intermediate_size=176)


def train(model: LlamaStyleModel, steps: int, smart: SmartSwap | None = None) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        loss = model(*make_batch(CFG, 2, 128, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if smart is not None:
            smart.step()
        losses.append(loss.detach())
    return losses


def saved_bytes(model: LlamaStyleModel) -> int:
    """Bytes of the distinct storages autograd saves in one forward (counted by our own hooks)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*make_batch(CFG, 2, 128, seed=0))
    return sum(storages.values())


def main() -> int:
    swap_pass.reset()
    torch.manual_seed(0)
    plain = LlamaStyleModel(CFG)
    model = copy.deepcopy(plain)
    budget = saved_bytes(plain) // 4  # a quarter of what the model saves without swap
    expected = train(plain, steps=8)
    with SmartSwap(model, memory_budget=budget) as smart:
        got = train(model, steps=8, smart=smart)
        print(f"stage after 8 steps: {smart.stage}")
        print(smart)  # one line; smart.policy.summary() describes the plan
        print(smart.policy.summary())
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (expected, got)
    stats = swap_pass.swap_stats()
    assert stats.swap_outs > 0 and stats.host_bytes_in_use == 0, stats
    print(f"budget {budget} bytes; swap-outs: {stats.swap_outs}")
    print("OK: losses bitwise equal with and without SmartSwap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
