"""The host work of one swapped layer call does not grow with the model's depth.

Counted in Python function calls (deterministic, unlike time): a per-layer step that walked
every earlier layer's manager would make a 32-layer model's calls per layer grow with depth.
"""

import sys

import torch

import swap_pass
from swap_pass.tools.bench.host_cost import HostCostModel


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


def test_calls_per_layer_do_not_grow_with_depth():
    shallow, deep = _swap_pass_calls_per_layer(8), _swap_pass_calls_per_layer(64)
    assert deep <= shallow * 1.1, (shallow, deep)


def test_guard_hook_runs_where_register_hook_would_put_it():
    """The guards skip ``register_hook``'s handle; their hooks must still run in registration
    order with the user's, and removing a user's hook must leave theirs in place."""
    from swap_pass.eager._protocol import _add_grad_hook

    x = torch.randn(3, requires_grad=True)
    y = x * 2
    order = []
    first = y.register_hook(lambda g: order.append("user 1"))
    _add_grad_hook(y, lambda g: order.append("guard"))
    y.register_hook(lambda g: order.append("user 2"))
    first.remove()
    z = x * 3  # a fresh output: the hook dict is made here, as register_hook would make it
    _add_grad_hook(z, lambda g: order.append("guard on fresh"))
    (y.sum() + z.sum()).backward()
    assert order.index("guard") < order.index("user 2") and "user 1" not in order
    assert "guard on fresh" in order
    leaf = torch.randn(2, requires_grad=True)  # no grad_fn: the public path
    _add_grad_hook(leaf, lambda g: order.append("leaf"))
    leaf.sum().backward()
    assert order[-1] == "leaf"
