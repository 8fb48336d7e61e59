"""A budget the peak cannot reach: the plan still lowers what it can, and says why it cannot.

See Note: [Budgets the peak cannot reach] in swap_pass/smart/policy.py.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import swap_pass
from swap_pass import SmartSwap
from tests.smart.helpers import no_hooks

N = 256 * 256 * 4  # bytes of one operand


class Square(nn.Module):
    """``(x + 1) * (x + 1)``: the product saves both operands; while it runs, the forward holds
    them too, so at that tick nothing can be off the device. After it, both could leave."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + 1) * (x + 1)).sum()


def _step(model: nn.Module, x: torch.Tensor, smart: SmartSwap) -> tuple[int, int]:
    """One step, exact against the model without SmartSwap; (bytes moved, bytes on the host
    when backward starts)."""
    before = swap_pass.swap_stats().swapped_out_bytes
    ref_x = x.detach().clone().requires_grad_()
    with no_hooks():
        ref_loss = model(ref_x)
        ref_loss.backward()
    on_host = []
    loss = model(x)
    loss.register_hook(lambda g: on_host.append(swap_pass.swap_stats().host_bytes_in_use))
    loss.backward()
    assert torch.equal(loss, ref_loss) and torch.equal(x.grad, ref_x.grad)
    x.grad = None
    smart.step()
    return swap_pass.swap_stats().swapped_out_bytes - before, on_host[0]


def test_stable_steps_free_at_least_what_the_conservative_steps_freed_and_say_why_not_more():
    x = torch.randn(256, 256, requires_grad=True)
    x_before = x.detach().clone()
    model = Square()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SmartSwap(model, memory_budget=0) as smart:
            moved = [(smart.stage.value, *_step(model, x, smart)) for _ in range(5)]
    conservative = [m for stage, m, _ in moved if stage != "stable"]
    stable = [(m, host) for stage, m, host in moved if stage == "stable"]
    assert conservative == [2 * N, 2 * N] and len(stable) == 3
    assert all(m >= 2 * N and host == 2 * N for m, host in stable)  # freed after the product
    assert torch.equal(x.detach(), x_before)
    policy = smart.policy
    assert not policy.feasible and policy.swap_bytes == 2 * N
    why = policy.unreachable
    assert f"the peak of {2 * N} B lies at tick" in why and "(forward)" in why
    assert f"{2 * N} B are still in use outside autograd" in why
    assert f"over budget because {why}" in policy.summary()
    ours = [str(w.message) for w in caught if "cannot be met" in str(w.message)]
    assert len(ours) == 1 and why in ours[0] and f"it moves {2 * N} B" in ours[0]
