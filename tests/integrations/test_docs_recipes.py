"""The one-call recipes in docs/megatron.md and docs/torchtitan.md run as written.

Each page's block under ``<!-- recipe: ... -->`` is executed with the names it expects from the
user's own code (``model`` and a batch) bound to the CPU test models, and the step it takes must
match the same model without swap, with swapping really done.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import swap_pass
from tests.eager.helpers import assert_clean

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
DOCS = Path(__file__).resolve().parents[2] / "docs"


def recipe(page: str) -> str:
    text = (DOCS / page).read_text()
    match = re.search(r"<!-- recipe:[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert match, f"docs/{page} has no recipe block"
    return match.group(1)


def _run(code: str, names: dict) -> dict:
    exec(compile(code, "<recipe>", "exec"), names)  # noqa: S102 - the docs' own code
    return names


def test_megatron_recipe_runs_as_written():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from tests.integrations import megatron_cpu as mc

    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    with mc.cpu_shims():
        mc.init_parallel()
        cfg = mc.make_config(recompute="full", method="uniform", recompute_layers=1)
        ref, model = mc.make_gpt(cfg), mc.make_gpt(cfg)
        batch = mc.make_batch()
        expected_loss, expected = mc.train_step(ref, batch)
        torch.manual_seed(7)
        mc.tensor_parallel_seed(7)
        names = _run(recipe("megatron.md"), {"model": model, **batch})
    assert torch.equal(names["loss"].detach(), expected_loss)
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
    assert swap_pass.swap_stats().swap_ins == 3
    assert_clean()
    assert not names["handle"].handles[0].active


def test_torchtitan_recipe_runs_as_written():
    from tests.integrations import torchtitan_cpu as tc

    tc.import_shim()
    pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed")
    ref, model = tc.make_llama3_debug(n_layers=4), tc.make_llama3_debug(n_layers=4)
    tokens, labels = tc.make_batch()
    expected_loss, expected = tc.train_step(ref, (tokens, labels))
    names = _run(recipe("torchtitan.md"), {"model": model, "tokens": tokens, "labels": labels})
    assert torch.equal(names["loss"].detach(), expected_loss)
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
    assert swap_pass.swap_stats().swap_ins == 3
    assert_clean()
