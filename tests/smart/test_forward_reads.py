"""Reads of saved tensors inside the forward do not start the backward.

``torch.autograd.grad`` inside a forward (a gradient penalty) and reads of ``grad_fn._saved_*``
unpack saved tensors while the forward still runs; the step stays one micro-batch and moves as
much as without them. See Note: [Reads of saved tensors inside the forward] in executor.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import SmartSwap
from tests.smart.helpers import no_hooks


class Net(nn.Module):
    """Four tanh layers; in the middle, a forward-time read of what was saved so far."""

    def __init__(self, read: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = 0
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(x))
            if i == 1 and self.read == "grad":  # a penalty on d(h)/d(x), kept in the graph
                (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
                extra = (g * g).mean()
            elif i == 1 and self.read == "saved":  # a monitor reading what tanh saved
                extra = h.grad_fn._saved_result.mean().detach() * 0
            x = h
        return (x * x).sum() + extra


def _steps(model: nn.Module, steps: int) -> list:
    ref = copy.deepcopy(model)
    x = torch.randn(64, 128, requires_grad=True)
    x_before = x.detach().clone()
    reports = []
    with (pytest.warns(RuntimeWarning, match="memory_budget=0.25 .* cannot be met"),
          SmartSwap(model, memory_budget=0.25) as smart):
        for _ in range(steps):
            rx = x.detach().clone().requires_grad_()
            with no_hooks():
                ref_loss = ref(rx)
                ref_loss.backward()
            loss = model(x)
            loss.backward()
            assert torch.equal(loss, ref_loss) and torch.equal(x.grad, rx.grad)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)
            x.grad = None
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            smart.step()
            reports.append(smart.last_report)
    assert torch.equal(x.detach(), x_before)
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    return reports


@pytest.mark.parametrize("read", ["grad", "saved"])
def test_a_forward_time_read_keeps_the_step_one_micro_batch(read):
    reports = _steps(Net(read), 4)
    assert all(r.micro_batches == 1 for r in reports), reports
    assert all(r.swapped_bytes > 0 for r in reports)
    plain = _steps(Net("none"), 2)
    # the conservative steps move at least what they move without the read (nothing of the
    # forward's second half is kept back because of it)
    assert reports[0].swapped_bytes >= plain[0].swapped_bytes
