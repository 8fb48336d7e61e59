"""``python -m swap_pass.graph.show`` prints the before/after graphs that docs/graph.md holds."""

from __future__ import annotations

import pytest
import torch

from swap_pass.graph.show import render


def test_show_prints_graphs_before_and_after():
    # budget mode on the 3-layer model cannot reach 0.5 of its peak, and warns that it did not
    with pytest.warns(UserWarning, match="memory_budget=0.5 not reached"):
        page = render()
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
