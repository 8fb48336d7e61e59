"""Stream races of the graph path: retained graphs.

Run on every device present (``device``): on the test accelerator (in its pass) side-stream
copies run late, and an unordered read, write or free it counts fails the test at teardown
(``tests/conftest.py``). The compiles take seconds on 2 CPU cores: the CPU case runs with the
slow tests, the accelerator's in its own pass.
"""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass.graph import ops
from tests.conftest import DEVICES
from tests.graph.helpers import batch, tiny_model


def _retained_twice(backend, data, device):
    """backward(retain_graph=True), a new forward, then the first graph's backward again."""
    torch._dynamo.reset()
    model = tiny_model(3, device=device)
    compiled = torch.compile(model, backend=backend)
    loss = compiled(*data)
    loss.backward(retain_graph=True)
    other = compiled(*batch(model, seed=1))  # its swap_out takes pooled host buffers
    loss.backward()
    other.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", [pytest.param(DEVICES[0], marks=pytest.mark.slow),
                                    DEVICES[1]], indirect=True)
def test_retained_graph_backward_after_a_new_forward_is_exact(device):
    """A host buffer goes back to the pool only when no graph can read it again."""
    data = batch(tiny_model(3, device=device))
    ref_loss, ref_grads = _retained_twice("aot_eager", data, device)
    loss, grads = _retained_twice(swap_pass.make_swap_backend("aot_eager"), data, device)
    assert swap_pass.swap_stats().swap_outs >= 4  # two layer inputs, two forwards
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    del loss
    torch._dynamo.reset()
    assert ops.pending_transfers() == 0
