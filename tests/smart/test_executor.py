"""The executor's safety rules, on small real modules: what may leave, what must come back."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import SmartSwap
from swap_pass.smart import SmartSwapConfig

from .helpers import grads_of, tiny_model

CONSERVATIVE = SmartSwapConfig(warmup_steps=1000, min_swap_bytes=0)  # stay in warmup: swap all


class Chain(nn.Module):
    """sin -> exp -> linear, so each op saves an activation for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x, keep=None):
        a = x.sin()
        b = (a * self.scale).exp()
        out = self.lin(b)
        if keep is not None:
            keep.append(a)
        return out.sum()


def _storages_saved_by(fn):
    """Run ``fn`` under an inner hook that records the storages packed (weakly)."""
    import weakref
    seen = []
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(t):
        seen.append((weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes()))
        return outer[0](t)

    with torch.autograd.graph.saved_tensors_hooks(pack, outer[1]):
        out = fn()
    return out, seen


def test_a_tensor_someone_still_holds_is_never_freed():
    model = Chain()
    x = torch.randn(4, 16, requires_grad=True)
    keep: list[torch.Tensor] = []
    with SmartSwap(model, memory_budget=0, config=CONSERVATIVE):
        loss, seen = _storages_saved_by(lambda: model(x, keep))
        held = keep[0].untyped_storage()
        assert held.nbytes() > 0  # `a` is still in `keep`: it stayed
        freed = [ref() for ref, n in seen if ref() is not None and ref().nbytes() == 0]
        assert freed, "nothing was swapped: the test would prove nothing"
        loss.backward()
    ref_model = copy.deepcopy(model)
    ref_model.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    ref_model(x2).backward()
    assert torch.equal(x.grad, x2.grad)
    for g, h in zip(grads_of(model), grads_of(ref_model), strict=True):
        assert torch.equal(g, h)


def test_parameters_buffers_and_inputs_are_never_swapped():
    model = Chain()
    x = torch.randn(4, 16, requires_grad=True)
    before = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    with SmartSwap(model, memory_budget=0, config=CONSERVATIVE):
        loss = model(x)
        for t, b in zip([*model.parameters(), *model.buffers(), x], [*before, x], strict=True):
            assert t.untyped_storage().nbytes() > 0 and torch.equal(t.detach(), b.detach())
        assert swap_pass.swap_stats().swap_outs > 0
        loss.backward()


class Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return (y * y).sin().sum()  # mul saves y twice (one storage); sin saves y*y


class Narrow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 32)

    def forward(self, x):
        return self.lin(x)[:, 5:9].sin().sum()  # sin saves a narrow view of the wide output


def _exact_vs_plain(model, x, check_during_forward):
    with SmartSwap(model, memory_budget=0, config=CONSERVATIVE):
        loss, seen = _storages_saved_by(lambda: model(x))
        check_during_forward(seen)
        loss.backward()
    xr = x.detach().clone().requires_grad_()
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref(xr).backward()
    assert torch.equal(x.grad, xr.grad)


def test_one_storage_saved_twice_moves_once_and_both_saves_see_it():
    def check(seen):
        s = swap_pass.swap_stats()
        assert s.swap_outs == 2 and s.swapped_out_bytes == 2 * 3 * 8 * 4  # y once, y*y once

    _exact_vs_plain(Square(), torch.randn(3, 8, requires_grad=True), check)


def test_a_view_of_a_bigger_activation_brings_back_the_whole_storage():
    def check(seen):
        wide = [ref() for ref, n in seen if n == 3 * 32 * 4]
        assert wide and all(s is not None and s.nbytes() == 0 for s in wide)  # freed whole

    _exact_vs_plain(Narrow(), torch.randn(3, 8, requires_grad=True), check)


def test_forward_without_backward_and_an_exception_leave_no_host_buffers(device):
    model = tiny_model().to(device)
    ids = torch.randint(0, 256, (2, 16)).to(device)
    with SmartSwap(model, memory_budget=0, config=CONSERVATIVE) as smart:
        loss = model(ids, ids)
        assert swap_pass.swap_stats().host_bytes_in_use > 0
        del loss
        gc.collect()
        assert swap_pass.swap_stats().host_bytes_in_use == 0
        smart.step()
        boom = model.layers[1].register_forward_hook(lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            model(ids, ids)
        boom.remove()
        gc.collect()
        assert swap_pass.swap_stats().host_bytes_in_use == 0
        smart.step()
        model(ids, ids).backward()  # hooks still consistent after the failure


def test_retain_graph_second_backward_is_exact(device):
    model = tiny_model().to(device)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 16)).to(device)
    with SmartSwap(model, memory_budget=0, config=CONSERVATIVE):
        loss = model(ids, ids)
        loss.backward(retain_graph=True)
        loss.backward()
    r = ref(ids, ids)
    r.backward(retain_graph=True)
    r.backward()
    for g, h in zip(grads_of(model), grads_of(ref), strict=True):
        assert torch.equal(g, h)


def test_no_grad_steps_move_nothing_and_leave_the_plan_alone():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 16))
    with SmartSwap(model, memory_budget=0.25) as smart:
        for _ in range(2):
            model(ids, ids).backward()
            smart.step()
        assert smart.stage == "stable"
        log, outs = smart.stage_log, swap_pass.swap_stats().swap_outs
        with torch.no_grad():
            model(ids, ids)
        smart.step()  # an evaluation step between training steps
        assert smart.last_report.keys == [] and swap_pass.swap_stats().swap_outs == outs
        model(ids, ids).backward()
        smart.step()
    assert smart.stage_log == log and smart.replans == 0


def test_hooks_are_removed_on_exit_and_kept_by_reset():
    model = tiny_model()
    smart = SmartSwap(model, memory_budget=0)
    with smart:
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with smart:
        swap_pass.reset()  # clears counters and pending state only
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(memory_budget=-1), "memory_budget=-1"),
    (dict(memory_budget=1.5), "memory_budget=1.5"),
    (dict(memory_budget=0, config=SmartSwapConfig), None),
])
def test_bad_arguments_name_what_must_hold(kwargs, match):
    if match is None:
        with pytest.raises(ValueError, match=r"swap_pass\.SmartSwapConfig: num_groups=0"):
            SmartSwapConfig(num_groups=0)
        return
    with pytest.raises(ValueError, match=rf"swap_pass\.SmartSwap: {match}.*must be"):
        SmartSwap(nn.Linear(2, 2), **kwargs)


class WritesSaved(nn.Module):
    def forward(self, x):
        y = x.exp()
        z = y.sin()  # saves y
        y.add_(1)  # ...then writes it: backward would read the wrong values
        return z.sum()


def test_inplace_write_after_save_is_caught_like_autograd_does():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        WritesSaved()(x).backward()  # plain autograd
    with SmartSwap(WritesSaved(), memory_budget=0, config=CONSERVATIVE) as smart:
        with pytest.raises(RuntimeError, match=r"swap_pass\.SmartSwap: .*modified by an inplace"):
            smart.model(x).backward()
