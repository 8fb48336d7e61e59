"""The shared memory model: torch's element sizes, one layer-input count and one host-memory
figure for ``plan`` and ``capacity``, and what the whole-step model needs."""

from __future__ import annotations

import pathlib

import pytest
import torch

from swap_pass.cost.model import DTYPES, itemsize
from swap_pass.tools.memory_model import (
    SWAP_RESIDENT_INPUTS,
    ModelShape,
    method_memory,
    resident_layer_inputs,
)
from swap_pass.tools.plan import PlanInputs, simulate

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
WORDS = {2: "two", 3: "three", 4: "four"}


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_dtype_sizes_are_the_bytes_torch_allocates(name):
    assert itemsize(name) == torch.empty(8, dtype=DTYPES[name]).untyped_storage().nbytes() // 8


@pytest.mark.parametrize("layers, micro_batches", [(1, 1), (2, 3), (3, 1), (6, 2), (32, 1)])
def test_plan_and_capacity_plan_the_same_layer_inputs(layers, micro_batches):
    sizes = {"hidden": 256, "seq": 128, "layers": layers, "batch": 2, "dtype": "fp16",
             "micro_batches": micro_batches}
    planned = simulate(PlanInputs(**sizes))
    shape = ModelShape(**sizes, heads=4, intermediate=704, vocab=512)
    assert planned.resident_inputs_with_swap == resident_layer_inputs(layers, True, micro_batches)
    assert planned.resident_inputs_with_swap == min(layers, SWAP_RESIDENT_INPUTS) * micro_batches
    assert planned.host_bytes_needed == method_memory(shape, "eager_swap").host_bytes
    assert planned.layer_input_bytes == 2 * 128 * 256 * 2


@pytest.mark.parametrize("page", ["usage.md", "capacity.md"])
def test_docs_state_the_modelled_layer_input_count(page):
    text = " ".join((DOCS / page).read_text().split())
    assert f"{WORDS[SWAP_RESIDENT_INPUTS]} layer inputs" in text.lower()


def test_whole_step_model_names_what_the_shape_lacks():
    shape = ModelShape(hidden=64, layers=2, seq=8)
    assert shape.layer_input_bytes == 8 * 64 * 2
    with pytest.raises(ValueError, match=r"swap_pass\.ModelShape: heads, intermediate, vocab"):
        method_memory(shape, "no_swap")
    fp8 = ModelShape(hidden=64, layers=2, seq=8, dtype="fp8", heads=2, intermediate=128, vocab=32)
    with pytest.raises(ValueError, match=r"dtype='fp8' has no whole-step memory model"):
        method_memory(fp8, "eager_swap")


@pytest.mark.parametrize("field, value", [("hidden", 0), ("heads", 0), ("dtype", "int3"),
                                          ("optimizer", "lion")])
def test_shape_rejects_bad_sizes_naming_the_field(field, value):
    sizes = {"hidden": 64, "layers": 2, "seq": 8, field: value}
    with pytest.raises(ValueError, match=rf"swap_pass\.ModelShape: {field}="):
        ModelShape(**sizes)
