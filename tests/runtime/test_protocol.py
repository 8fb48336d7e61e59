"""The layer-input protocol's steps, as every way in calls them (swap_pass/runtime/chain.py)."""

from __future__ import annotations

import pytest
import torch

from swap_pass import SwapConfig, SwapTensors
from swap_pass.runtime.chain import free_if_unheld, prefetch_ahead, restore_for_backward
from swap_pass.runtime.freeing import autograd_mark


def _copying_out(x: torch.Tensor) -> SwapTensors:
    group = SwapTensors([x], name="layers[0]", copy_span=True)
    group.swap_to_host()
    group.entry_mark = autograd_mark()
    return group


def test_free_if_unheld_frees_what_only_autograd_holds(device) -> None:
    w = torch.randn(64, device=device, requires_grad=True)
    x = w * 2
    ref = x.detach().clone()
    group = _copying_out(x)
    y = x.sin()  # the layer: saves x for backward
    assert free_if_unheld(group, "layers[0]", [y])
    assert x.untyped_storage().nbytes() == 0 and group.stat == "host"
    fifo = [group]
    restore_for_backward(group, fifo, reader="test")
    assert fifo == [] and torch.equal(x, ref)
    y.sum().backward()
    assert torch.equal(w.grad, torch.cos(ref) * 2)


def test_free_if_unheld_keeps_a_storage_another_tensor_holds(device) -> None:
    x = torch.randn(64, device=device, requires_grad=True) * 1
    kept = x.detach()[:8]  # a view the caller keeps: a holder autograd did not save
    group = _copying_out(x)
    y = x.sin()
    with pytest.warns(RuntimeWarning, match="shares its storage"):
        assert not free_if_unheld(group, "layers[0]", [y])
    assert x.untyped_storage().nbytes() == 64 * 4 and group.stat == "d2h"
    group.restore()
    assert torch.equal(kept, x.detach()[:8])


@pytest.mark.parametrize(("prefetch_layers", "max_copies", "started"),
                         [(1, None, 1), (2, None, 2), (3, 1, 1), (3, None, 3)])
def test_prefetch_ahead_keeps_to_its_limits(device, prefetch_layers, max_copies, started) -> None:
    groups = [SwapTensors([torch.randn(16, device=device)]) for _ in range(4)]
    for group in groups:
        group.swap_to_host()
        group.wait_d2h()
    config = SwapConfig(prefetch_layers=prefetch_layers, max_copies_in_flight=max_copies)
    prefetch_ahead(groups, config)
    assert [g.stat for g in groups] == ["h2d"] * started + ["host"] * (4 - started)
    prefetch_ahead([groups[3], None, groups[2]], SwapConfig(prefetch_layers=3))
    assert groups[3].stat == "h2d" and groups[2].stat == ("h2d" if started == 3 else "host")
    for group in groups:
        group.restore()
