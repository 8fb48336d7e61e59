"""The host work of one swapped layer call does not grow with the model's depth.

Counted in Python function calls (deterministic, unlike time): a per-layer step that walked
every earlier layer's manager would make a 32-layer model's calls per layer grow with depth.
"""

import sys

import pytest
import torch

import swap_pass
from swap_pass.bench.host_cost import HostCostModel


def _swap_pass_calls_per_layer(layers: int) -> float:
    torch.manual_seed(0)
    model = HostCostModel(layers)
    handle = swap_pass.enable_swap_layer_input(model)
    x = torch.randn(1, 4, 8, requires_grad=True)
    model(x).backward()  # warm-up: first-call work (registration, pool misses)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call" and "swap_pass" in frame.f_code.co_filename:
            calls += 1

    swaps = swap_pass.swap_stats().swap_outs
    sys.setprofile(count)
    try:
        model(x).backward()
    finally:
        sys.setprofile(None)
        handle.remove()
    assert swap_pass.swap_stats().swap_outs - swaps == layers - 1  # every layer but the last
    return calls / layers


@pytest.mark.no_stream_model  # the model's own bookkeeping is Python calls too
def test_calls_per_layer_do_not_grow_with_depth():
    shallow, deep = _swap_pass_calls_per_layer(8), _swap_pass_calls_per_layer(64)
    assert deep <= shallow * 1.1, (shallow, deep)
