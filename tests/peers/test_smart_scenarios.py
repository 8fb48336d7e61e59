"""The peers' scenarios that SmartSwap once failed: sparse
saved tensors (torchtune, save_on_cpu), entering inside ``disable_saved_tensors_hooks``
(PyTorch), unreachable budgets (TRL's min offload size taken to zero) and a forward-time
``autograd.grad``. Each is exact against the same model without swap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import SmartSwap
from swap_pass.smart import SmartSwapConfig
from tests.peers.helpers import exact_steps, twins

CONFIG = SmartSwapConfig(min_swap_bytes=0)


class SparseMix(nn.Module):
    """Multiplies by a sparse COO matrix, which autograd saves for backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(32, 32)
        dense = torch.randn(64, 64) * (torch.rand(64, 64) < 0.1)
        self.register_buffer("mix", dense.to_sparse())

    def forward(self, x):
        return torch.sparse.mm(self.mix, self.lin(x)).square().mean()


def _xbatches(n=4, shape=(64, 32)):
    return [(torch.randn(*shape, generator=torch.Generator().manual_seed(i)),) for i in range(n)]


def _unmet_budget():
    """These small models' forwards hold more than half the peak: SmartSwap says so, once."""
    return pytest.warns(RuntimeWarning, match="memory_budget=0.5 .* cannot be met")


def test_sparse_saved_tensor_is_kept_and_counted():
    """torchtune / save_on_cpu with sparse saved tensors: kept on the device, counted."""
    ref, model = twins(SparseMix)
    with (pytest.warns(RuntimeWarning, match=r"stays on the device \(no_storage\)"),
          _unmet_budget(),
          SmartSwap(model, memory_budget=0.5, config=CONFIG) as smart):
        exact_steps(ref, model, lambda m, b: m(b[0]), _xbatches(), smart=smart)
    assert swap_pass.swap_stats().skipped_bytes.get("no_storage", 0) > 0


def test_failed_enter_inside_disabled_hooks_leaves_no_hooks():
    """test_autograd's disable_saved_tensors_hooks: a refused enter leaves the model as before."""
    ref, model = twins(lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)))
    smart = SmartSwap(model, memory_budget=0.5, config=CONFIG)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError):
            smart.__enter__()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with smart, _unmet_budget():  # entering again works
        exact_steps(ref, model, lambda m, b: m(b[0]).square().mean(), _xbatches(3), smart=smart)


class Squares(nn.Module):
    def forward(self, x):
        return ((x + 1) * (x + 1)).sum()


def test_unreachable_budget_still_moves_bytes_in_stable_steps():
    """TRL-style budget of 0 on (x+1)*(x+1): the stable steps still lower what they can."""
    model = Squares()
    x = torch.randn(256, 256, requires_grad=True)
    x_before = x.detach().clone()
    (expected,) = torch.autograd.grad(Squares()(x), x)
    with SmartSwap(model, memory_budget=0, config=CONFIG) as smart:
        with pytest.warns(RuntimeWarning, match="memory_budget=0 B cannot be met"):
            for _ in range(4):
                x.grad = None
                model(x).backward()
                assert torch.equal(x.grad, expected) and torch.equal(x.detach(), x_before)
                smart.step()
        x.grad = None
        out = model(x)
        freed = swap_pass.swap_stats().device_bytes_released
        out.backward()
    assert torch.equal(x.grad, expected)
    assert smart.stage == "stable" and freed > 0


class GradInForward(nn.Module):
    """Calls autograd.grad inside forward (a gradient penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        x = x.requires_grad_(True) if not x.requires_grad else x
        h = torch.tanh(self.lin(x))
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return h.square().mean() + g.square().mean()


def test_forward_time_autograd_grad_stays_exact_and_moves_bytes():
    """PyTorch's double-backward tests: autograd.grad inside forward, under SmartSwap."""
    ref, model = twins(GradInForward)
    batches = [(torch.randn(64, 32, generator=torch.Generator().manual_seed(i)),) for i in range(4)]
    with _unmet_budget(), SmartSwap(model, memory_budget=0.5, config=CONFIG) as smart:
        exact_steps(ref, model, lambda m, b: m(b[0].clone()), batches, smart=smart)
    assert swap_pass.swap_stats().swapped_out_bytes > 0
