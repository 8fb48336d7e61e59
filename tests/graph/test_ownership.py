"""``apply_swap_pass`` follows the ownership rule: what the user or a sibling holds stays put.

See Note: [Ownership rule] in ``swap_pass/runtime/freeing.py``. Gradients are compared bitwise
with the same traced model without swap; the user's tensors with their values before the step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import fx, nn

import swap_pass
from swap_pass.tools.models import LlamaDecoderLayer
from tests.graph.helpers import tiny_model


class Chunked(nn.Module):
    """The tiny model's layers fed from the caller's tensor, or from one half of a projection
    whose other half is read after the layers (GLU style)."""

    def __init__(self, glu: bool) -> None:
        super().__init__()
        self.inner = tiny_model(4)
        self.glu = glu
        self.proj = nn.Linear(16, 32)

    def forward(self, x, cos, sin):
        if self.glu:
            x, gate = self.proj(x).chunk(2, dim=-1)
        for layer in self.inner.layers:
            x = layer(x, cos, sin)
        return (x * torch.sigmoid(gate)).square().mean() if self.glu else x.square().mean()


def _grads(model, args):
    model.zero_grad(set_to_none=True)
    loss = model(*args)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _check(glu: bool, x: torch.Tensor):
    ref = Chunked(glu)
    gm = swap_pass.apply_swap_pass(fx.symbolic_trace(copy.deepcopy(ref)))
    assert any("swap_pass_out" in n.name for n in gm.graph.nodes)  # the pass did insert swaps
    cos, sin = ref.inner.cos_table[:8], ref.inner.sin_table[:8]
    ref_loss, ref_grads = _grads(ref, (x, cos, sin))
    loss, grads = _grads(gm, (x, cos, sin))
    assert torch.equal(ref_loss, loss)
    assert ref_grads.keys() == grads.keys()
    assert all(torch.equal(ref_grads[n], grads[n]) for n in ref_grads)
    return swap_pass.swap_stats()


def test_chunk_of_user_data_into_the_graph_stays_intact():
    data = torch.randn(4, 8, 16, requires_grad=True)  # requires grad: the graph would swap it
    before = data.detach().clone()
    x, y = data.chunk(2)
    stats = _check(False, x)
    assert torch.equal(data.detach(), before) and torch.equal(y.detach(), before[2:])
    assert stats.skipped_user_bytes == data.untyped_storage().nbytes()
    assert stats.peak_device_bytes_released > 0  # layers 1-2 were swapped and freed


def test_glu_half_whose_sibling_is_read_later_stays_on_device():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = _check(True, torch.randn(2, 8, 16))
    assert stats.skipped_shared_bytes == 2 * 8 * 32 * 4
    assert sum("shares its storage" in str(w.message) for w in caught) == 1
    assert stats.peak_device_bytes_released > 0


# --- a layer that keeps an alias of its input (a monitoring hook, a cache) ---------------------

_KEPT: list[torch.Tensor] = []


def keep_alias(x: torch.Tensor, kind: str) -> None:
    """What a monitoring hook keeps of a layer input: a ``.detach()``, a view or a slice."""
    _KEPT.append({"detach": x.detach, "view": lambda: x.view(-1, x.shape[-1]),
                  "slice": lambda: x[:, :2]}[kind]())


fx.wrap("keep_alias")


class KeepingLayer(LlamaDecoderLayer):
    def __init__(self, cfg, kind: str | None) -> None:
        super().__init__(cfg)
        self.kind = kind

    def forward(self, hidden_states, cos, sin):
        if self.kind is not None:
            keep_alias(hidden_states, self.kind)
        return super().forward(hidden_states, cos, sin)


@pytest.mark.parametrize("kind", ["detach", "view", "slice"])
def test_kept_alias_of_a_layer_input_in_a_traced_graph_reads_right(kind):
    """Layer 1 of a traced model keeps an alias of its input: that storage stays, the rest leave."""
    ref = Chunked(False)
    for i, old in enumerate(ref.inner.layers):  # one class for every layer: the pass finds them
        ref.inner.layers[i] = KeepingLayer(ref.inner.cfg, kind if i == 1 else None)
        ref.inner.layers[i].load_state_dict(old.state_dict())
    gm = swap_pass.apply_swap_pass(fx.symbolic_trace(copy.deepcopy(ref)))
    assert sum("swap_pass_out" in n.name for n in gm.graph.nodes) == 3
    cos, sin = ref.inner.cos_table[:8], ref.inner.sin_table[:8]
    x = torch.randn(2, 8, 16, requires_grad=True).clone()  # computed: the first layer may swap it
    _KEPT.clear()
    ref_loss, ref_grads = _grads(ref, (x, cos, sin))
    kept_ref = _KEPT.pop()
    gm.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = gm(x, cos, sin)
    stats = swap_pass.swap_stats()
    assert torch.equal(_KEPT[-1], kept_ref)  # read before backward: right values
    assert stats.peak_device_bytes_released == 2 * 2 * 8 * 16 * 4  # layers 0 and 2 freed
    assert stats.skipped_bytes["shared_storage"] == 2 * 8 * 16 * 4  # layer 1's input kept
    assert sum("shares its storage" in str(w.message) for w in caught) == 1
    loss.backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}
    assert torch.equal(ref_loss, loss.detach()) and ref_grads.keys() == grads.keys()
    assert all(torch.equal(ref_grads[n], grads[n]) for n in ref_grads)
    assert torch.equal(_KEPT[-1], kept_ref)
