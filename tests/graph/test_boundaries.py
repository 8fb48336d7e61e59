"""find_layer_boundaries on every kind of graph, layer_filter, and its errors."""

from __future__ import annotations

import pytest
import torch

from swap_pass.graph.boundaries import find_layer_boundaries, normalize_fqn
from swap_pass.tools.models import LlamaDecoderLayer

from .helpers import (
    TraceableLlama,
    batch,
    capture_aot_graphs,
    capture_dynamo_graph,
    hf_llama_tiny,
    tiny_model,
    trace,
)

L = 3


def _check(bounds, fqns, inputs=None):
    assert [b.fqn for b in bounds] == fqns
    assert [b.index for b in bounds] == list(range(len(fqns)))
    if inputs is not None:
        assert [b.node for b in bounds] == inputs
    assert all(b.node is not None for b in bounds)
    assert "layer 0" in str(bounds[0])


@pytest.mark.parametrize("leaf_layers", [False, True], ids=["inlined", "call_module"])
def test_symbolic_trace(leaf_layers):
    gm = trace(TraceableLlama(tiny_model(L)), leaf_layers=leaf_layers)
    bounds = find_layer_boundaries(gm)
    _check(bounds, [f"model.layers.{i}" for i in range(L)])
    assert bounds[0].node == "model_embed"
    if leaf_layers:
        assert [b.node for b in bounds[1:]] == ["model_layers_0", "model_layers_1"]


@pytest.mark.parametrize("recompute", [False, True])
def test_dynamo_graph(recompute):
    model = tiny_model(L, recompute=recompute)
    gm = capture_dynamo_graph(model, *batch(model))
    bounds = find_layer_boundaries(gm)
    _check(bounds, [f"layers.{i}" for i in range(L)])
    producers = {n.name: n for n in gm.graph.nodes}
    assert "embedding" in str(producers[bounds[0].node].target)


def test_export_graph():
    model = tiny_model(L)
    ep = torch.export.export(model, batch(model))
    _check(find_layer_boundaries(ep.graph_module), [f"layers.{i}" for i in range(L)],
           ["embedding", "add_5", "add_11"])
    _check(find_layer_boundaries(ep.module()), [f"layers.{i}" for i in range(L)])


@pytest.mark.parametrize("recompute", [False, True])
def test_aot_forward_and_backward_graphs(recompute):
    model = tiny_model(L, recompute=recompute)
    fw, bw = capture_aot_graphs(model, *batch(model))
    fw_bounds, bw_bounds = find_layer_boundaries(fw), find_layer_boundaries(bw)
    _check(fw_bounds, [f"layers.{i}" for i in range(L)])
    _check(bw_bounds, [f"layers.{i}" for i in range(L)])
    # the saved layer inputs are forward outputs and backward placeholders of the same name
    placeholders = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    assert [b.node for b in bw_bounds] == [b.node for b in fw_bounds]
    assert {b.node for b in bw_bounds} <= placeholders


def test_hf_llama_tiny():
    model = hf_llama_tiny(num_layers=L)
    ids = torch.randint(0, 32, (2, 8))
    gm = capture_dynamo_graph(model, ids)
    bounds = find_layer_boundaries(gm)
    _check(bounds, [f"model.layers.{i}" for i in range(L)])
    assert {b.layer_type for b in bounds} == {"LlamaDecoderLayer"}
    fw, bw = capture_aot_graphs(lambda i: model(input_ids=i, labels=i).loss, ids)
    _check(find_layer_boundaries(fw), [f"model.layers.{i}" for i in range(L)])
    _check(find_layer_boundaries(bw), [f"model.layers.{i}" for i in range(L)])


@pytest.mark.parametrize("layer_filter", [
    r"model\.layers\.[01]",
    (LlamaDecoderLayer,),
    LlamaDecoderLayer,
    lambda fqn, cls: fqn.endswith(("layers.0", "layers.1")),
])
def test_layer_filter_overrides_the_guess(layer_filter):
    gm = trace(TraceableLlama(tiny_model(L)))
    bounds = find_layer_boundaries(gm, layer_filter=layer_filter)
    expected = L if layer_filter is LlamaDecoderLayer or isinstance(layer_filter, tuple) else 2
    assert [b.fqn for b in bounds] == [f"model.layers.{i}" for i in range(expected)]


def test_layer_filter_on_sub_blocks():
    gm = trace(TraceableLlama(tiny_model(L)))
    bounds = find_layer_boundaries(gm, layer_filter=r"model\.layers\.\d+\.mlp")
    assert [b.fqn for b in bounds] == [f"model.layers.{i}.mlp" for i in range(L)]


def test_layer_filter_matching_nothing_is_an_error():
    gm = trace(TraceableLlama(tiny_model(L)))
    with pytest.raises(ValueError, match=r"swap_pass\.find_layer_boundaries: layer_filter='blocks.*"
                                         r"matched none .* It must match"):
        find_layer_boundaries(gm, layer_filter=r"blocks\.\d+")


def test_not_a_graph_module_is_an_error():
    with pytest.raises(TypeError, match=r"swap_pass\.find_layer_boundaries: expected a "
                                        r"torch\.fx\.GraphModule, got LlamaStyleModel"):
        find_layer_boundaries(tiny_model(2))


def test_no_repeated_blocks_finds_nothing():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    assert find_layer_boundaries(gm) == []


@pytest.mark.parametrize("path,expected", [
    ("L['self'].layers.0", "layers.0"),
    ("L['args'][0].model.layers.3.mlp", "model.layers.3.mlp"),
    ("L['self']._modules['layers']._modules['2']", "layers.2"),
    ("L['self'].layers[1]", "layers.1"),
    ("layers.4", "layers.4"),
])
def test_normalize_fqn(path, expected):
    assert normalize_fqn(path) == expected
