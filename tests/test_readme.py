"""The README's Python snippets run as written (a newcomer copies them first), and say true
things."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import swap_pass
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
# Calls the "Ways in" table shows; each must be run by a snippet, spelled as in the table.
TABLE_CALLS = ["swap_pass.enable_swap_layer_input(model)", "handle.remove()",
               "swap_pass.apply_swap_pass(torch.fx.symbolic_trace(model))",
               "find_layer_boundaries(", 'make_swap_backend(inner="aot_eager")',
               "swap_pass.SmartSwap(model, memory_budget=", "smart.step()"]


def _run(index: int, capsys) -> str:
    swap_pass.reset()
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {})
    return capsys.readouterr().out


def test_readme_has_snippets() -> None:
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("call", TABLE_CALLS)
def test_table_calls_are_in_a_snippet(call: str) -> None:
    assert call in TEXT.split("## Ways in")[1].split("```")[0]  # the table shows it
    assert any(call in s for s in SNIPPETS)


def _check_eager(out: str) -> None:
    assert out.strip().splitlines()[-1] == str(7 * ONE)  # "7 layer inputs were off the device"


def _check_ways_in(out: str) -> None:
    """The traced and compiled rows report their saving in the same field as eager."""
    for way in ("traced:", "compile:"):
        line = next(row for row in out.splitlines() if row.startswith(way))
        assert f"peak_device_bytes_released={3 * ONE}," in line, line
    assert "SmartSwap(model=LlamaStyleModel" in out and "stage='stable'" in out
    assert max(len(row) for row in out.splitlines()) < 400  # short reprs


ONE = 2 * 64 * LlamaConfig().hidden_size * 4  # one layer input: batch 2, seq 64, fp32
CHECKS = {"enable_swap_layer_input(model)": _check_eager, "apply_swap_pass(": _check_ways_in}


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index: int, capsys) -> None:
    out = _run(index, capsys)
    for marker, check in CHECKS.items():
        if marker in SNIPPETS[index]:
            check(out)


def test_every_check_has_its_snippet() -> None:
    assert all(any(marker in s for s in SNIPPETS) for marker in CHECKS)


def test_symbolic_trace_of_bundled_model_matches_eager_bitwise() -> None:
    torch.manual_seed(0)
    model = LlamaStyleModel(LlamaConfig(num_layers=3))
    ids, labels = make_batch(model.cfg, batch=2, seq=16)
    gm = swap_pass.apply_swap_pass(torch.fx.symbolic_trace(model))
    targets = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("layer_input_swap_out") == 2, targets  # layers 0 and 1, not the last
    loss = gm(ids, labels)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    expected = model(ids, labels)
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters(), strict=True))
    assert swap_pass.swap_stats().swap_outs == 2
