"""The ownership rule: a swap never frees a storage that something else can still read.

See Note: [Ownership rule] in ``swap_pass/runtime/freeing.py``. Every test compares gradients
bitwise with the same model without swap and the user's tensors with their values before the
step, and shows that the swap did free something (so the test can fail).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass.tools.models import LlamaDecoderLayer
from tests.eager.helpers import CFG, assert_clean, assert_exact


class Stack(nn.Module):
    """Four tiny Llama layers fed straight from the caller: no embedding in front.

    ``prep`` picks what the first layer receives: the input itself, a projection of it, one
    half of a projection whose other half is read after the layers (GLU style), a small slice
    of a projection nobody else holds, or a view of a module buffer.
    """

    def __init__(self, prep: str = "input") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.prep = prep
        self.proj = nn.Linear(CFG.hidden_size, 2 * CFG.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(CFG) for _ in range(4))
        self.register_buffer("start", torch.randn(4, 8, CFG.hidden_size))
        angles = (torch.arange(8).float()[:, None]
                  / (10 ** torch.arange(CFG.hidden_size // 4).float()))
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def _first_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.prep == "glu":
            a, g = self.proj(x).chunk(2, dim=-1)
            return a, g
        if self.prep == "slice":
            return self.proj(x).view(-1, 8, CFG.hidden_size)[:1], None  # 1/8 of the storage
        if self.prep == "buffer":
            return self.start[: x.shape[0]], None  # x only sets the batch size
        return x, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self._first_input(x)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return h * torch.sigmoid(gate) if gate is not None else h


def _step(model: nn.Module, x: torch.Tensor, during=None):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    if during is not None:
        during()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _pair(prep: str = "input"):
    ref = Stack(prep)
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
    return ref, model, handle


def _freed_inputs(handle) -> list[bool]:
    """Per layer: is an input of it off the device right now?"""
    return [any(g.stat == "host" for g in m.batch_stack) for m in handle.managers]


def test_sibling_views_of_user_data_stay_intact():
    ref, model, handle = _pair()
    data = torch.randn(4, 8, CFG.hidden_size)
    x, y = data.chunk(2)
    before = data.clone()
    seen = {}

    def during():
        seen["data_bytes"] = data.untyped_storage().nbytes()
        seen["y_equal"] = torch.equal(y, before[2:])  # read a sibling between forward and backward
        seen["freed"] = _freed_inputs(handle)

    assert_exact(_step(ref, x), _step(model, x, during))
    assert seen == {"data_bytes": before.untyped_storage().nbytes(), "y_equal": True,
                    "freed": [False, True, True, False]}
    assert torch.equal(data, before)
    assert swap_pass.swap_stats().skipped_user_bytes == data.untyped_storage().nbytes()
    handle.remove()
    assert_clean()


def test_slices_of_user_data_requiring_grad_stay_intact():
    ref, model, handle = _pair()
    data = torch.randn(2, 8, 2 * CFG.hidden_size, requires_grad=True)
    before = data.detach().clone()
    left, right = data[..., : CFG.hidden_size], data[..., CFG.hidden_size:]
    assert_exact(_step(ref, left), _step(model, left, lambda: torch.equal(right, before[..., 32:])))
    assert (torch.equal(right.detach(), before[..., CFG.hidden_size:])
            and torch.equal(data.detach(), before))
    assert swap_pass.swap_stats().peak_device_bytes_released > 0
    handle.remove()


def test_glu_half_whose_sibling_is_read_later_is_kept_and_counted():
    ref, model, handle = _pair("glu")
    x = torch.randn(2, 8, CFG.hidden_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_exact(_step(ref, x), _step(model, x))
    shared = [w for w in caught if "shares its storage" in str(w.message)]
    assert len(shared) == 1 and f"{handle.module_tag}.layers[0]" in str(shared[0].message)
    stats = swap_pass.swap_stats()
    assert stats.skipped_shared_bytes == 2 * 2 * 8 * 2 * CFG.hidden_size * 4  # two steps
    assert stats.device_bytes_released == 0 and stats.peak_device_bytes_released > 0  # 1, 2 freed
    handle.remove()
    assert_clean()


def test_small_slice_nobody_else_holds_copies_only_its_span():
    ref, model, handle = _pair("slice")
    x = torch.randn(4, 8, CFG.hidden_size)  # proj -> 4*8*64 floats, viewed (8, 8, 32); [:1] is 1/8
    seen = {}

    def during():
        first = handle.managers[0].batch_stack[0]
        seen["storage_bytes"] = first.tensors[0].untyped_storage().nbytes()
        seen["host_bytes"] = first.host_nbytes

    assert_exact(_step(ref, x), _step(model, x, during))
    assert seen == {"storage_bytes": 0, "host_bytes": 8 * CFG.hidden_size * 4}
    handle.remove()
    assert_clean()


def test_buffer_input_is_never_freed_and_the_checkpoint_loads():
    ref, model, handle = _pair("buffer")
    before = model.start.clone()
    x = torch.randn(2, 8, CFG.hidden_size, requires_grad=True)
    seen = {}

    def during():
        seen["bytes"] = model.start.untyped_storage().nbytes()
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        Stack("buffer").load_state_dict(torch.load(buf))

    assert_exact(_step(ref, x), _step(model, x, during))
    assert seen["bytes"] == before.untyped_storage().nbytes() and torch.equal(model.start, before)
    assert swap_pass.swap_stats().peak_device_bytes_released > 0  # layers 1-2 still swap
    handle.remove()


@pytest.mark.parametrize("kind", ["leaf", "leaf_requiring_grad", "kept_non_leaf"])
def test_dropped_loss_leaves_the_users_input_intact(kind):
    _, model, handle = _pair()
    raw = torch.randn(2, 8, CFG.hidden_size, requires_grad=kind != "leaf")
    x = raw * 1.0 if kind == "kept_non_leaf" else raw
    before = x.detach().clone()
    loss = model(x).square().mean()  # evaluation with grad on: the loss is never back-propagated
    freed_now = x.untyped_storage().nbytes() == 0
    del loss
    assert freed_now == (kind != "leaf")  # a leaf needing no grad is never freed; others come back
    assert torch.equal(x.detach(), before)
    assert swap_pass.swap_stats().peak_device_bytes_released > 0
    handle.remove()
    assert_clean()


def test_reentrant_segments_of_two_layers_free_what_they_copy():
    """Segments of two layers under reentrant checkpoint: copy, free, restore, nothing left."""

    class Segments(Stack):
        def forward(self, x):
            def seg(h, a, b):
                return b(a(h, self.cos, self.sin), self.cos, self.sin)
            h = self.proj(x)[..., : CFG.hidden_size].contiguous()
            for i in range(0, 4, 2):
                h = torch.utils.checkpoint.checkpoint(seg, h, self.layers[i], self.layers[i + 1],
                                                      use_reentrant=True)
            return h

    ref = Segments()
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
    x = torch.randn(2, 8, CFG.hidden_size)
    for _ in range(3):
        assert_exact(_step(ref, x), _step(model, x))
        assert swap_pass.swap_stats().host_bytes_in_use == 0
    stats = swap_pass.swap_stats()
    assert stats.peak_device_bytes_released == 2 * 8 * CFG.hidden_size * 4  # segment 0's input
    assert stats.swap_ins == 3  # freed, then restored, once per step
    handle.remove()
    assert_clean()


class _PassThrough(torch.autograd.Function):
    """Returns its input as is, as FSDP2's pre-forward hook does with inputs that need grad:
    autograd hands on a view of the input with this Function's ``grad_fn``."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Received(Stack):
    """The first layer gets a whole alias of the caller's leaf (``alias``), an alias of an alias
    the model still references (``nested``), a part of the leaf (``part``), or a whole alias of
    a parameter (``parameter``)."""

    def __init__(self, prep: str) -> None:
        super().__init__(prep)
        self.held = nn.Parameter(torch.randn(2, 8, CFG.hidden_size))

    def _first_input(self, x):
        if self.prep == "parameter":
            return _PassThrough.apply(self.held), None  # x is not read
        if self.prep == "part":
            return x[:2], None
        if self.prep == "nested":  # the outer alias stays referenced, as a stage's argument does
            self.outer = _PassThrough.apply(x)
            return _PassThrough.apply(self.outer), None
        return _PassThrough.apply(x), None


@pytest.mark.parametrize("prep", ["alias", "nested", "part", "parameter"])
def test_a_whole_alias_of_a_leaf_needing_grad_is_swapped_like_the_leaf(prep):
    """A pipeline stage under ``fully_shard`` gets an alias of its received leaf: swapped, with
    the leaf's gradient exact, and the leaf reads as swapped out until backward (an error, where
    reading the freed storage would crash the process); a part of a leaf and an alias of a
    parameter stay the caller's, and an alias with a second alias still referenced stays,
    counted and warned."""
    ref = _Received(prep)
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
    rows = 3 if prep == "part" else 2
    raw = torch.randn(rows, 8, CFG.hidden_size)
    xs = [raw.clone().requires_grad_() for _ in range(2)]
    seen = {}

    def during():
        seen["freed"] = _freed_inputs(handle)
        seen["leaf"] = xs[1].untyped_storage().nbytes()
        if prep == "alias":  # the caller's leaf is guarded with its alias: an error, no crash
            with pytest.raises(swap_pass.SwapDataError):
                xs[1].sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_exact(_step(ref, xs[0]), _step(model, xs[1], during))
    if prep != "parameter":
        assert torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(xs[1].detach(), raw)
    stats = swap_pass.swap_stats()
    first_swapped = prep == "alias"
    assert seen["freed"] == [first_swapped, True, True, False]
    assert (seen["leaf"] == 0) == first_swapped
    kept = {"part": "user_data", "parameter": "user_data", "nested": "shared_storage"}
    assert list(stats.skipped_bytes) == ([kept[prep]] if prep in kept else [])
    hints = [w for w in caught if "fully_shard" in str(w.message)]
    assert len(hints) == (prep == "nested"), [str(w.message) for w in caught]
    handle.remove()
    assert_clean()
