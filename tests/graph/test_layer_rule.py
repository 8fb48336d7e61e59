"""One layer rule for every way in (Note: [The layer family rule] in swap_pass/layer_family.py):
eager's finder, find_layer_boundaries on fx and Dynamo graphs, and swap_backend agree."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import enable_swap_layer_input, find_layer_boundaries, make_swap_backend
from swap_pass.eager import find_layer_blocks

from .helpers import capture_dynamo_graph

D = 16


class MoE(nn.Module):
    """Eight experts in a ModuleList: more than the two decoder layers, never the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(8)])

    def forward(self, x):
        return sum(e(x) for e in self.experts) / 8


class SeqMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        return self.mlp(x)


class Layer(nn.Module):
    def __init__(self, ffn: type) -> None:
        super().__init__()
        self.norm, self.ffn = nn.LayerNorm(D), ffn()

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class Model(nn.Module):
    def __init__(self, ffn: type = MoE, holder: str = "list") -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [Layer(ffn) for _ in range(3)]
        if holder == "list":
            self.layers = nn.ModuleList(blocks)
        elif holder == "dict":
            self.layers = nn.ModuleDict(
                {name: b for name, b in zip(("first", "mid", "last"), blocks, strict=True)})
        else:  # named attributes
            self.block_a, self.block_b, self.block_c = blocks
        self.head = nn.Linear(D, D)

    def blocks(self):
        if hasattr(self, "layers"):
            return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict)
                        else self.layers)
        return [self.block_a, self.block_b, self.block_c]

    def forward(self, x):
        x = x * 2
        for block in self.blocks():
            x = block(x)
        return self.head(x).square().mean()


CASES = [(MoE, "list"), (SeqMLP, "list"), (SeqMLP, "dict"), (SeqMLP, "attrs")]


def _names(model, blocks):
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in blocks]


@pytest.mark.parametrize("ffn, holder", CASES, ids=[f"{f.__name__}-{h}" for f, h in CASES])
def test_every_way_in_finds_the_same_outer_blocks(ffn, holder):
    model = Model(ffn, holder)
    x = torch.randn(2, 4, D)
    want = _names(model, model.blocks())
    found = find_layer_blocks(model)
    eager = _names(model, found.values() if isinstance(found, nn.ModuleDict) else found)
    fx_gm = torch.fx.symbolic_trace(model)
    dynamo_gm = capture_dynamo_graph(model, x)
    assert eager == want
    assert [b.fqn for b in find_layer_boundaries(fx_gm)] == want
    assert [b.fqn for b in find_layer_boundaries(dynamo_gm)] == want
    with enable_swap_layer_input(model) as handle:
        assert _names(model, handle.layers) == want


@pytest.mark.parametrize("ffn, holder", [(MoE, "list"), (SeqMLP, "attrs")],
                         ids=["MoE-list", "SeqMLP-attrs"])
def test_swap_backend_swaps_the_outer_blocks_inputs_bitwise(ffn, holder):
    model = Model(ffn, holder)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, D)
    backend = make_swap_backend("aot_eager")
    swap_pass.reset()
    losses, released = [], []
    for m, b in ((model, backend), (ref, "aot_eager")):
        torch._dynamo.reset()
        losses.append(torch.compile(m, backend=b, fullgraph=True)(x))
        released.append(swap_pass.swap_stats().device_bytes_released)  # between fw and bw
        losses[-1].backward()
    assert torch.equal(*losses)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    swapped = [s.layer for s in backend.partitions[-1].swapped]
    assert swapped == _names(model, model.blocks())[:2]
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 2 * x.numel() * 4
    assert released[0] == stats.swapped_out_bytes
