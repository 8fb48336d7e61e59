"""swap_backend where Dynamo splits the model: graph breaks, graphs without layers, layer_filter,
compiled autograd, and the warning when a compiled model swaps nothing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import make_swap_backend

OPS = torch.ops.swap_pass


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(self.up(x).relu())


class Stack(nn.Module):
    """Six blocks and a head; ``brk`` says where Dynamo must break the graph."""

    def __init__(self, brk: str = "between", n: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block() for _ in range(n)])
        self.head = nn.Linear(16, 16)
        self.brk = brk

    def forward(self, x):
        x = x * 2  # the first layer's input is made here, not a graph input
        if self.brk == "between":  # unrolled: Dynamo resumes after the break in a new graph
            x = self.layers[2](self.layers[1](self.layers[0](x)))
            torch._dynamo.graph_break()
            x = self.layers[5](self.layers[4](self.layers[3](x)))
        for layer in self.layers if self.brk != "between" else ():
            x = layer(x)
            if self.brk == "every":  # in the loop: Dynamo compiles each layer on its own
                torch._dynamo.graph_break()
        return self.head(x).square().mean()


def _step(model, backend):
    torch._dynamo.reset()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    kept = x.clone()
    loss = torch.compile(model, backend=backend)(x)
    loss.backward()
    assert torch.equal(x, kept)
    return loss.detach()


def _assert_same_as_without_swap(model, ref, loss, ref_loss):
    assert torch.equal(loss, ref_loss)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_last_layer_of_a_graph_is_swapped_when_more_layers_follow_in_the_next_graph():
    """A break after layer 2: the first graph's last layer input lives through the second graph,
    so it is swapped too (Note: [Layers across graph breaks]); the model's last layer is not."""
    model, ref = Stack("between"), None
    ref = copy.deepcopy(model)
    backend = make_swap_backend("aot_eager")
    swap_pass.reset()
    loss = _step(model, backend)
    ref_loss = _step(ref, "aot_eager")
    _assert_same_as_without_swap(model, ref, loss, ref_loss)
    swapped = [s.layer for p in backend.partitions for s in p.swapped]
    # layer 3's input is the second graph's input (kept by the graph that made it); layer 5 is last
    assert swapped == ["layers.0", "layers.1", "layers.2", "layers.4"], swapped
    first_bw = backend.partitions[0].backward
    assert [n.target for n in first_bw.graph.nodes].count(OPS.prefetch.default) == 3
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == 4 and stats.host_bytes_in_use == 0


def test_one_layer_per_graph_warns_once_with_the_fix():
    """A break inside the layer loop: Dynamo compiles each layer's body alone, no graph holds a
    family of layers, nothing is swapped, and one warning names compile_layers."""
    model = Stack("every")
    ref = copy.deepcopy(model)
    backend = make_swap_backend("aot_eager")
    swap_pass.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _step(model, backend)
    ours = [w for w in caught
            if "swap_pass.swap_backend: a compiled graph swaps nothing" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "compile_layers" in str(ours[0].message)
    assert all(not p.swapped for p in backend.partitions) and len(backend.partitions) > 1
    assert swap_pass.swap_stats().skips["no_layers"] == len(backend.partitions)
    assert swap_pass.swap_stats().skipped_bytes["no_layers"] > 0
    _assert_same_as_without_swap(model, ref, loss, _step(ref, "aot_eager"))


def test_layer_filter_passes_graphs_without_a_match_through():
    """The head after the break holds no layer the filter names: that graph compiles unchanged
    (no error, no warning), the layers' graph swaps."""
    class HeadAfterBreak(Stack):
        def forward(self, x):
            x = x * 2
            for layer in self.layers:
                x = layer(x)
            torch._dynamo.graph_break()
            return self.head(x).square().mean()

    model = HeadAfterBreak()
    ref = copy.deepcopy(model)
    backend = make_swap_backend("aot_eager", layer_filter=r"layers\.\d+")
    swap_pass.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _step(model, backend)
    assert not [w for w in caught if "swap_pass" in str(w.message)]
    # all six: the last layer's output leaves the graph, the head follows in another one
    assert [len(p.swapped) for p in backend.partitions] == [6, 0]
    _assert_same_as_without_swap(model, ref, loss, _step(ref, "aot_eager"))


def test_compiled_autograd_is_refused_before_anything_runs():
    model = Stack("none")
    x = torch.randn(4, 16)
    before = [p.detach().clone() for p in model.parameters()]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(Exception, match=r"swap_pass\.swap_backend: compiled autograd is on"):
            torch.compile(model, backend=make_swap_backend("aot_eager"))(x).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert swap_pass.swap_stats().host_bytes_in_use == 0


class HeldAcrossBreak(Stack):
    """Layers 3..5 reached, after a break, through a local held across it: Dynamo records them
    under the local's name (``L['layers'][3]``, ``L['blocks'].3``), not ``layers.3``."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held

    def forward(self, x):
        x = x * 2
        layers = list(self.layers) if self.held == "list" else self.layers
        for layer in layers[:3]:
            x = layer(x)
        torch._dynamo.graph_break()
        if self.held == "list":
            for layer in layers[3:]:
                x = layer(x)
        else:
            x = layers[5](layers[4](layers[3](x)))
        return self.head(x).square().mean()


@pytest.mark.parametrize("layer_filter", [r"layers\.\d+", Block, None],
                         ids=["regex", "class", "guess"])
@pytest.mark.parametrize("held", ["list", "module_list"])
def test_layers_held_in_a_local_across_a_break_keep_their_qualified_names(held, layer_filter):
    """Note: [Module names in resumed frames]: the resumed graph names layers 3..5 as the model
    does, so a regex on qualified names, a class, and the family rule all find them: layer 4's
    input is swapped (layer 3's is the graph's input, layer 5 is the last)."""
    model = HeldAcrossBreak(held)
    ref = copy.deepcopy(model)
    backend = make_swap_backend("aot_eager", layer_filter=layer_filter)
    swap_pass.reset()
    loss = _step(model, backend)
    ref_loss = _step(ref, "aot_eager")
    _assert_same_as_without_swap(model, ref, loss, ref_loss)
    swapped = [[s.layer for s in p.swapped] for p in backend.partitions]
    assert swapped == [["layers.0", "layers.1", "layers.2"], ["layers.4"]], swapped
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == 4 and stats.host_bytes_in_use == 0
