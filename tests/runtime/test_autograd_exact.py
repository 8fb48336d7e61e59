"""A saved tensor freed after forward and restored before backward gives exact gradients."""

from __future__ import annotations

import torch

from swap_pass import SwapTensors


def _loss_and_grads(swap: bool, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(16, 32).to(device)
    lin2 = torch.nn.Linear(32, 8).to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    h = torch.tanh(lin1(x))  # tanh saves its output h; lin2 saves h too
    out = lin2(h)
    loss = out.pow(2).sum()
    if swap:
        group = SwapTensors([h])
        group.swap_to_host()
        group.wait_d2h()
        assert h.untyped_storage().nbytes() == 0
        group.swap_to_device()
        group.wait_h2d()
    loss.backward()
    return loss.detach(), [x.grad, *(p.grad for p in (*lin1.parameters(), *lin2.parameters()))]


def test_gradients_bitwise_after_swap(device) -> None:
    ref_loss, ref_grads = _loss_and_grads(False, device)
    loss, grads = _loss_and_grads(True, device)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)

