"""``enable_swap_layer_input`` is all or nothing: a failure leaves the model and process as before.

See Note: [Enabling is all or nothing] in ``swap_pass/eager/enable.py``. Each case fails at a
different point of the patching (a block early, in the middle, last; the model's handle), with
real objects that refuse the change, and then checks that no block is patched, no manager is
registered, the model computes exactly what it did, and the same call fails the same way again
(nothing half-enabled is left to say "already enabled").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass.runtime.chain import SwapLayerInputManager
from swap_pass.tools.models import LlamaDecoderLayer
from tests.eager.helpers import CFG, assert_clean


class ReadOnlyForward(LlamaDecoderLayer):
    """A block whose ``forward`` is a property without setter: it cannot be shadowed."""

    @property
    def forward(self):
        return super().forward


class RefusesHandle(nn.Module):
    """A model whose handle attribute is a read-only property."""

    @property
    def _swap_pass_handle(self):
        return None


def _model(bad_layer: int | None, model_cls=nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = model_cls()
    model.layers = nn.ModuleList(
        (ReadOnlyForward if i == bad_layer else LlamaDecoderLayer)(CFG) for i in range(4))
    if bad_layer != 1:  # an instance-level forward another tool set: it must survive
        model.layers[1].forward = model.layers[1].forward
    return model


def _run(model, x, cos, sin):
    h = x
    for layer in model.layers:
        h = layer(h, cos, sin)
    return h


def _tags() -> set[str]:
    return {t for t in SwapLayerInputManager.manager_map if t.startswith("enable_swap_layer_input")}


@pytest.mark.parametrize("where", ["first_block", "middle_block", "last_block", "model_handle"])
def test_a_failed_enable_leaves_nothing_behind(where):
    """Patching fails at one point; the model and the registry are as before the call."""
    bad = {"first_block": 0, "middle_block": 2, "last_block": 3, "model_handle": None}[where]
    model = _model(bad, RefusesHandle if where == "model_handle" else nn.Module)
    x = torch.randn(2, 8, CFG.hidden_size)
    cos = torch.ones(8, CFG.hidden_size // 4)
    sin = torch.zeros(8, CFG.hidden_size // 4)
    before_out = _run(model, x, cos, sin).detach()
    before_dicts = [dict(layer.__dict__) for layer in model.layers]
    for _ in range(2):  # the second call fails the same way: nothing was left half-enabled
        with pytest.raises(AttributeError):
            swap_pass.enable_swap_layer_input(model, layers=model.layers)
        assert _tags() == set()
        assert "_swap_pass_handle" not in model.__dict__
        for layer, d in zip(model.layers, before_dicts, strict=True):
            assert "swap_manager" not in layer.__dict__
            assert layer.__dict__.get("forward") is d.get("forward")
    after = _run(model, x, cos, sin)
    assert torch.equal(after.detach(), before_out)
    after.square().mean().backward()  # plain autograd, nothing swapped
    assert swap_pass.swap_stats().swap_outs == 0
    assert_clean()
