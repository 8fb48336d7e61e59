"""``swap_stats()`` measures the saving of compiled graphs as it does for the eager paths."""

from __future__ import annotations

import gc

import torch

import swap_pass
from swap_pass import make_swap_backend

from .helpers import batch, tiny_model, twin

L = 4


def _compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, backend=make_swap_backend("aot_eager"), fullgraph=True)


def test_released_bytes_counted_between_forward_and_backward() -> None:
    model = tiny_model(L, recompute=True)
    ref = twin(model)
    ids, labels = batch(model)
    swap_pass.reset()
    loss = _compiled(model)(ids, labels)
    s = swap_pass.swap_stats()
    one = ids.numel() * model.cfg.hidden_size * 4  # one fp32 layer input
    assert s.swap_outs == L - 1 and s.swapped_out_bytes == (L - 1) * one
    # Counted only by the finalizer of each swapped storage: the graph really dropped them.
    assert s.device_bytes_released == s.peak_device_bytes_released == (L - 1) * one
    loss.backward()
    s = swap_pass.swap_stats()
    assert s.swap_ins == L - 1 and s.device_bytes_released == 0
    assert s.peak_device_bytes_released == (L - 1) * one and s.host_bytes_in_use == 0
    torch._dynamo.reset()
    expected = torch.compile(ref, backend="aot_eager", fullgraph=True)(ids, labels)
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad)
               for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_forward_without_backward_gives_the_bytes_back() -> None:
    model = tiny_model(L, recompute=True)
    swap_pass.reset()
    loss = _compiled(model)(*batch(model))
    assert swap_pass.swap_stats().device_bytes_released > 0
    del loss
    gc.collect()
    s = swap_pass.swap_stats()
    assert s.device_bytes_released == 0 and s.host_bytes_in_use == 0


def test_reset_zeroes_the_released_gauge() -> None:
    model = tiny_model(L, recompute=True)
    swap_pass.reset()
    loss = _compiled(model)(*batch(model))
    assert swap_pass.swap_stats().device_bytes_released > 0
    swap_pass.reset()
    assert swap_pass.swap_stats().device_bytes_released == 0
    del loss
    gc.collect()
    assert swap_pass.swap_stats().device_bytes_released == 0
