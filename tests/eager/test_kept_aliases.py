"""A layer that keeps a ``.detach()``, a view or a slice of its input: the storage stays.

See Note: [Ownership rule] and Note: [Telling saved aliases from kept ones] in
``swap_pass/runtime/freeing.py``. Monitoring hooks and caches keep such aliases during forward
and read them before backward; before the check at free time the storage was freed under them
and the read crashed the process (exit 139 on CPU). Every test compares loss and gradients
bitwise with the same model without swap, checks the kept tensors' values against that model's,
and shows that the other layers' inputs were still freed (so the test can fail).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import swap_pass
from swap_pass.tools.models import LlamaDecoderLayer
from tests.eager.helpers import CFG, assert_clean, assert_exact

KINDS = ("detach", "view", "slice")


def keep_alias(h: torch.Tensor, kind: str) -> torch.Tensor:
    """What a monitoring hook or a cache keeps of a layer input."""
    if kind == "detach":
        return h.detach()
    if kind == "view":
        return h.view(-1, h.shape[-1])
    return h[:, :2]  # a slice


class KeepingLayer(nn.Module):
    """A tiny Llama layer that keeps an alias of its input in ``self.kept`` when ``kind`` is set."""

    def __init__(self, kind: str | None) -> None:
        super().__init__()
        self.inner = LlamaDecoderLayer(CFG)
        self.kind = kind
        self.kept: list[torch.Tensor] = []

    def forward(self, hidden_states, cos, sin):
        if self.kind is not None:
            self.kept.append(keep_alias(hidden_states, self.kind))
        return self.inner(hidden_states, cos, sin)


class DecoratedKeepingLayer(KeepingLayer):
    """The same layer decorated the MindSpeed way."""

    swap_module_tag = "tests.kept_aliases"

    @swap_pass.swap_layer_input_init_wrapper
    def __init__(self, kind: str | None) -> None:
        super().__init__(kind)

    @swap_pass.swap_layer_input_forward_wrapper
    def forward(self, hidden_states, cos, sin):
        return super().forward(hidden_states, cos, sin)


class Stack(nn.Module):
    """A projection, then four layers; layer ``keeper`` keeps an alias of its input."""

    def __init__(self, kind: str | None, keeper: int = 1, layer_cls=KeepingLayer) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(CFG.hidden_size, CFG.hidden_size)
        self.layers = nn.ModuleList(layer_cls(kind if i == keeper else None) for i in range(4))
        angles = (torch.arange(8).float()[:, None]
                  / (10 ** torch.arange(CFG.hidden_size // 4).float()))
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return h.square().mean()


def _step(model, x, during=None):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    if during is not None:
        during()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _twins(kind, way):
    if way == "enable":
        ref = Stack(kind)
        model = copy.deepcopy(ref)
        handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
        return ref, model, handle.remove
    swap_pass.reset()
    ref = Stack(kind)  # plain layers: the reference
    model = Stack(kind, layer_cls=DecoratedKeepingLayer)
    model.load_state_dict(ref.state_dict())
    return ref, model, swap_pass.reset


@pytest.mark.parametrize("way", ["enable", "decorators"])
@pytest.mark.parametrize("kind", KINDS)
def test_kept_alias_reads_right_before_backward_and_its_storage_stays(kind, way):
    """Layer 1 keeps an alias of its input; it reads right between forward and backward."""
    ref, model, undo = _twins(kind, way)
    x = torch.randn(2, 8, CFG.hidden_size)
    x_before = x.clone()
    seen = {}

    def during():  # read the kept alias while the other layers' inputs are off the device
        kept = model.layers[1].kept[-1]
        seen["equal"] = torch.equal(kept, ref.layers[1].kept[-1])
        seen["sum"] = kept.sum().item()
        seen["freed"] = swap_pass.swap_stats().device_bytes_released

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_exact(_step(ref, x), _step(model, x, during))
    group_bytes = 2 * 8 * CFG.hidden_size * 4
    assert seen["equal"] and seen["freed"] == 2 * group_bytes  # layers 0 and 2 freed, 1 kept
    assert torch.equal(model.layers[1].kept[-1], ref.layers[1].kept[-1])  # after backward too
    assert torch.equal(x, x_before)
    stats = swap_pass.swap_stats()
    assert stats.skipped_bytes["shared_storage"] == group_bytes
    shared = [w for w in caught if "shares its storage" in str(w.message)]
    assert len(shared) == 1 and "layers[1]" in str(shared[0].message)
    undo()
    assert_clean()


def test_forward_hook_keeping_a_detached_input_keeps_that_storage():
    """A monitoring forward hook (run after the layer's forward) keeps ``inputs[0].detach()``."""
    ref, model, undo = _twins(None, "enable")
    kept_ref, kept = [], []
    ref.layers[2].register_forward_hook(lambda m, inputs, out: kept_ref.append(inputs[0].detach()))
    model.layers[2].register_forward_hook(lambda m, inputs, out: kept.append(inputs[0].detach()))
    x = torch.randn(2, 8, CFG.hidden_size)
    seen = {}

    def during():
        seen["equal"] = torch.equal(kept[-1], kept_ref[-1])
        seen["freed"] = swap_pass.swap_stats().device_bytes_released

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_exact(_step(ref, x), _step(model, x, during))
    assert seen == {"equal": True, "freed": 2 * 2 * 8 * CFG.hidden_size * 4}
    assert swap_pass.swap_stats().skipped_bytes["shared_storage"] == 2 * 8 * CFG.hidden_size * 4
    undo()
    assert_clean()


class SavingViewLayer(nn.Module):
    """A layer whose ops save views of its input for backward: ``F.linear`` on a 3-D input (a
    2-D view made in C++) and a matmul on a 2-D view made here; with ``keep`` it also keeps that
    2-D view (the very tensor autograd saved)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(CFG.hidden_size, CFG.hidden_size)
        self.keep = keep
        self.kept: list[torch.Tensor] = []

    def forward(self, h):
        flat = h.view(-1, h.shape[-1])
        if self.keep:
            self.kept.append(flat)
        return (torch.tanh(F.linear(h, self.lin.weight, self.lin.bias))
                + (flat @ self.lin.weight).view_as(h))


class SavingStack(nn.Module):
    def __init__(self, keeper: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(CFG.hidden_size, CFG.hidden_size)
        self.layers = nn.ModuleList(SavingViewLayer(i == keeper) for i in range(4))

    def forward(self, x):
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return h.square().mean()


def test_views_autograd_saved_inside_the_layer_do_not_stop_the_free():
    """Holders autograd made inside the layer are told apart from kept ones: all inputs leave."""
    ref = SavingStack()
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
    x = torch.randn(2, 8, CFG.hidden_size)
    seen = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no shared-storage warning
        assert_exact(_step(ref, x), _step(model, x, lambda: seen.update(
            freed=swap_pass.swap_stats().device_bytes_released)))
    assert seen["freed"] == 3 * 2 * 8 * CFG.hidden_size * 4  # layers 0-2; the last is never swapped
    assert swap_pass.swap_stats().skipped_bytes.get("shared_storage", 0) == 0
    handle.remove()
    assert_clean()


def test_a_view_both_kept_and_saved_by_autograd_keeps_the_storage():
    """A view autograd saved that the layer also keeps is the user's: the storage stays."""
    ref = SavingStack(keeper=1)
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
    x = torch.randn(2, 8, CFG.hidden_size)
    seen = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_exact(_step(ref, x), _step(model, x, lambda: seen.update(
            equal=torch.equal(model.layers[1].kept[-1], ref.layers[1].kept[-1]),
            freed=swap_pass.swap_stats().device_bytes_released)))
    assert seen == {"equal": True, "freed": 2 * 2 * 8 * CFG.hidden_size * 4}
    assert swap_pass.swap_stats().skipped_bytes["shared_storage"] == 2 * 8 * CFG.hidden_size * 4
    handle.remove()
    assert_clean()


_CHILD = textwrap.dedent("""
    import copy, sys, torch, swap_pass
    from tests.eager.test_kept_aliases import Stack
    for kind in ("detach", "view", "slice"):
        ref, model = Stack(kind), None
        model = copy.deepcopy(ref)
        swap_pass.enable_swap_layer_input(model, layers=model.layers)
        loss = model(torch.randn(2, 8, 32))
        print(kind, model.layers[1].kept[-1].sum().item(), flush=True)  # read before backward
        loss.backward()
    print("done")
""")


def test_reading_kept_aliases_before_backward_does_not_crash_a_process():
    """The three reads in a child process: a freed storage under them would kill it (SIGSEGV)."""
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout.splitlines()[-1] == "done"
