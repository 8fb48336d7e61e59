"""Entering and leaving SmartSwap is one transaction: a failure leaves nothing behind.

See Note: [Entering and leaving as one transaction] in swap_pass/smart/smart_swap.py.
"""

from __future__ import annotations

import pytest
import torch

from swap_pass import SmartSwap
from swap_pass.smart import smart_swap as smart_swap_module
from tests.smart.helpers import Pair


def _hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_entering_inside_disable_saved_tensors_hooks_leaves_nothing_and_a_later_enter_works():
    pair = Pair()
    smart = SmartSwap(pair.model, memory_budget=0.5)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError, match="no hooks here"):
            smart.__enter__()
    assert _hook_counts(pair.model) == 0 and _top_hooks() is None
    assert smart_swap_module._active == []
    with smart:  # neither "entered twice" nor "inside another SmartSwap"
        for _ in range(3):
            pair.step(smart)  # exact against the model without SmartSwap
    assert smart.stage == "stable" and smart.last_report.swapped_bytes > 0
    assert _hook_counts(pair.model) == 0 and _top_hooks() is None


def test_a_failure_after_the_module_hooks_were_added_removes_them(monkeypatch):
    pair = Pair()
    smart = SmartSwap(pair.model, memory_budget=0.5)

    def failing_begin():
        raise RuntimeError("failed after the hooks were in place")
    monkeypatch.setattr(smart, "_begin", failing_begin)
    with pytest.raises(RuntimeError, match="after the hooks"):
        with smart:
            pass
    assert _hook_counts(pair.model) == 0 and _top_hooks() is None
    assert smart_swap_module._active == []
    monkeypatch.undo()
    with smart:
        pair.step(smart)
    assert _hook_counts(pair.model) == 0 and _top_hooks() is None


def test_leaving_removes_every_hook_even_when_popping_the_saved_tensor_hooks_fails():
    pair = Pair()
    smart = SmartSwap(pair.model, memory_budget=0.5)
    smart.__enter__()
    torch._C._autograd._pop_saved_tensors_default_hooks()  # someone popped ours already
    with pytest.raises(RuntimeError):
        smart.__exit__(None, None, None)
    assert _hook_counts(pair.model) == 0 and _top_hooks() is None
    assert smart_swap_module._active == []
    with smart:
        pair.step(smart)


def test_module_hooks_are_on_only_inside_with_and_every_enter_tracks_the_call_sites_again():
    pair = Pair()
    smart = SmartSwap(pair.model, memory_budget=0.5)
    assert _hook_counts(pair.model) == 0  # building SmartSwap adds no hook
    counts = []
    for _ in range(2):
        with smart:
            counts.append(_hook_counts(pair.model))
            for _ in range(3):
                pair.step(smart)  # exact against the model without SmartSwap
            report = smart.last_report
            # stable: every saved tensor matched its plan entry by its call site and shape
            assert report.stage == "stable" and report.unmatched == 0 and report.matched > 0
        assert _hook_counts(pair.model) == 0 and _top_hooks() is None
    assert counts[0] > 0 and counts == [counts[0]] * 2
