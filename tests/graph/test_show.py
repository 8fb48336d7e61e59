"""``python -m swap_pass.tools.graph_show`` prints the before/after graphs docs/graph.md holds."""

from __future__ import annotations

import warnings

import torch

from swap_pass.tools.graph_show import render


def test_show_prints_graphs_before_and_after():
    # Budget mode on the 3-layer model may fall short of 0.5 of its peak (it does on torch 2.13,
    # not on 2.15): then it warns that it did, and nothing else may warn.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page = render()
    assert all("memory_budget=0.5 not reached" in str(w.message) for w in caught), caught
    text, budget = page.split("## Budget mode")
    before_fw, after_fw = text.split("### Forward graph before the pass")[1].split(
        "### Forward graph after the pass")
    after_fw, rest = after_fw.split("### Backward graph before the pass")
    before_bw, after_bw = rest.split("### Backward graph after the pass")
    assert "swap_pass" not in before_fw and "swap_pass" not in before_bw
    assert after_fw.count("torch.ops.swap_pass.swap_out") == 2
    assert after_fw.count("torch.ops.swap_pass.wait") == 2
    assert after_bw.count("torch.ops.swap_pass.prefetch") == 2
    assert after_bw.count("torch.ops.swap_pass.wait") == 2
    assert "swap_pass_release_model_layers_1" in text
    assert "budget: " in budget and "torch.ops.swap_pass.swap_out" in budget
    torch._dynamo.reset()
