"""``SwapConfig`` checks types strictly, and every entry point refuses a config of another type."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig


@pytest.mark.parametrize("kwargs", [
    {"prefetch": "no"}, {"use_streams": "false"}, {"pin_memory": 0}, {"prefetch": None},
    {"max_host_bytes": True}, {"min_swap_bytes": False}, {"min_swap_bytes": 1.5},
    {"max_host_bytes": "1GB"},
])
def test_wrong_types_are_refused_naming_the_field(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(TypeError, match=rf"swap_pass\.SwapConfig: {name}={value!r} is a "):
        SwapConfig(**kwargs)


def test_right_types_are_accepted():
    cfg = SwapConfig(max_host_bytes=0, min_swap_bytes=7, prefetch=False, pin_memory=False,
                     use_streams=False)
    assert cfg.max_host_bytes == 0 and cfg.min_swap_bytes == 7 and cfg.prefetch is False
    assert SwapConfig(max_host_bytes=None).max_host_bytes is None


def _two_layers() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))


def _gm() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("api, call", [
    ("enable_swap_layer_input",
     lambda c: swap_pass.enable_swap_layer_input(_two_layers(), config=c)),
    ("apply_swap_pass", lambda c: swap_pass.apply_swap_pass(_gm(), config=c)),
    ("make_swap_backend", lambda c: swap_pass.make_swap_backend("aot_eager", config=c)),
    ("SmartSwap", lambda c: swap_pass.SmartSwap(torch.nn.Linear(4, 4), memory_budget=1, config=c)),
    ("SmartSwapConfig.swap", lambda c: swap_pass.SmartSwapConfig(swap=c)),
    ("SwapLayerInputManager", lambda c: swap_pass.SwapLayerInputManager("cfg-types", config=c)),
    ("SwapTensors", lambda c: swap_pass.SwapTensors([torch.ones(4)], config=c)),
])
def test_a_dict_config_is_a_type_error_naming_swap_config(api, call):
    with pytest.raises(TypeError, match=rf"swap_pass\.{api}: config is a dict .*SwapConfig"):
        call({"prefetch": False})
    assert not swap_pass.SwapLayerInputManager.managers("cfg-types")
