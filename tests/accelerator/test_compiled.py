"""The compiled way in on the test accelerator: ``swap_backend`` over ``aot_eager`` (Inductor
cannot generate code for the device) is bitwise equal to ``aot_eager`` without swap."""

from __future__ import annotations

import torch

import swap_pass
from swap_pass import make_swap_backend
from swap_pass.models import LlamaConfig, LlamaStyleModel, make_batch

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=2, intermediate_size=48)


def _two_steps(backend, dev: torch.device) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=True).to(dev)
    ids, labels = make_batch(CFG, 2, 16, device=dev)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = compiled(ids, labels)
        loss.backward()
        steps.append((loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]))
    return steps


def test_swap_backend_over_aot_eager_is_bitwise_equal(dev) -> None:
    expected = _two_steps("aot_eager", dev)
    swap_pass.reset()
    got = _two_steps(make_swap_backend(inner="aot_eager"), dev)
    assert swap_pass.swap_stats().swap_outs >= 2 * (CFG.num_layers - 1)
    for (loss_ref, grads_ref), (loss, grads) in zip(expected, got, strict=True):
        assert torch.equal(loss, loss_ref)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
    torch._dynamo.reset()
