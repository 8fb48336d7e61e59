"""Every handle an enabling call returns undoes it once, also on leaving ``with``."""

from __future__ import annotations

import pytest

import swap_pass
from swap_pass.graph.regional import compile_layers
from swap_pass.handles import SwapHandle
from swap_pass.integrations.megatron import MegatronSwapHandle
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=48)


@pytest.mark.parametrize("enable", [
    swap_pass.enable_swap_layer_input,
    lambda model: MegatronSwapHandle([swap_pass.enable_swap_layer_input(model)]),
    lambda model: compile_layers(model, backend="eager"),
], ids=["enable_swap_layer_input", "megatron", "compile_layers"])
def test_remove_is_idempotent_and_runs_on_leaving_with(enable) -> None:
    model = LlamaStyleModel(CFG)
    with enable(model) as handle:
        assert isinstance(handle, SwapHandle) and handle.active
        assert repr(handle).endswith("active=True)")
        assert len(swap_pass.SwapLayerInputManager.manager_map) == 1
        assert all("forward" in layer.__dict__ for layer in model.layers)
    assert not handle.active and repr(handle).endswith("active=False)")
    assert not swap_pass.SwapLayerInputManager.manager_map
    assert not any("forward" in layer.__dict__ for layer in model.layers)
    handle.remove()  # a second remove changes nothing
    with enable(model) as again:  # the model can be enabled again
        assert again.active
