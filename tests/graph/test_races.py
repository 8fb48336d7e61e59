"""Stream races of the graph path, shown under the CPU stream model: retained graphs."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass.graph import ops
from swap_pass.testing import stream_model
from tests.graph.helpers import batch, tiny_model

pytestmark = pytest.mark.no_stream_model  # runs its own model


def _retained_twice(backend, data):
    """backward(retain_graph=True), a new forward, then the first graph's backward again."""
    torch._dynamo.reset()
    model = tiny_model(3)
    compiled = torch.compile(model, backend=backend)
    loss = compiled(*data)
    loss.backward(retain_graph=True)
    other = compiled(*batch(model, seed=1))  # its swap_out takes pooled host buffers
    loss.backward()
    other.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_retained_graph_backward_after_a_new_forward_is_exact():
    """A host buffer goes back to the pool only when no graph can read it again."""
    data = batch(tiny_model(3))
    ref_loss, ref_grads = _retained_twice("aot_eager", data)
    with stream_model(seed=0) as model:
        loss, grads = _retained_twice(swap_pass.make_swap_backend("aot_eager"), data)
    assert swap_pass.swap_stats().swap_outs >= 4  # two layer inputs, two forwards
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert not model.hazards
    del loss
    torch._dynamo.reset()
    assert ops.pending_transfers() == 0
