"""torchtune's OffloadActivations scenarios, written for swap_pass's ways in.

Each test compares a few steps bitwise with the same model without swap and shows that bytes
left the device (``swap_stats().peak_device_bytes_released``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass import SmartSwap, SwapConfig
from swap_pass.smart import SmartSwapConfig
from tests.peers.helpers import HIDDEN, BlockStack, LinearBlock, exact_steps, moved, twins


def _loss(model, batch):
    return model(batch[0])


def _batches(n: int = 3):
    return [(torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(i)),)
            for i in range(n)]


@pytest.mark.parametrize("use_streams", [True, False])
def test_same_as_without_swap(use_streams):
    """torchtune test_offloading_is_same_as_without[use_streams]: Linear/ReLU blocks, eager."""
    ref, model = twins(BlockStack)
    handle = swap_pass.enable_swap_layer_input(model, config=SwapConfig(use_streams=use_streams))
    exact_steps(ref, model, _loss, _batches())
    assert moved() == 3 * 2 * 8 * HIDDEN * 4  # every block input but the last
    handle.remove()


@pytest.mark.parametrize("use_streams", [True, False])
def test_same_as_without_swap_smart(use_streams):
    """torchtune test_offloading_is_same_as_without[use_streams], under SmartSwap."""
    ref, model = twins(BlockStack)
    config = SmartSwapConfig(min_swap_bytes=0, swap=SwapConfig(use_streams=use_streams))
    with SmartSwap(model, memory_budget=0.5, config=config) as smart:
        exact_steps(ref, model, _loss, _batches(4), smart=smart)
    assert swap_pass.swap_stats().swapped_out_bytes > 0


class ViewTwice(nn.Module):
    """A block that reads its input twice (two ops save it) and returns a view of its result."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.w = nn.Parameter(torch.randn(HIDDEN) / HIDDEN)

    def forward(self, x):
        y = self.a(x) * x + torch.sigmoid(x * self.w)  # x saved by two ops
        return y.transpose(0, 1).contiguous().transpose(0, 1)  # a view out


def test_view_output_and_input_used_twice():
    """torchtune test_offloading_works_with_view_outputs and its tensor used twice."""
    ref, model = twins(lambda: BlockStack(block=ViewTwice))
    handle = swap_pass.enable_swap_layer_input(model)
    exact_steps(ref, model, _loss, _batches())
    assert moved() == 3 * 2 * 8 * HIDDEN * 4
    handle.remove()


def test_view_output_and_input_used_twice_smart():
    """The same, under SmartSwap: one saved storage read by two ops moves once."""
    ref, model = twins(lambda: BlockStack(block=ViewTwice))
    with SmartSwap(model, memory_budget=0.5, config=SmartSwapConfig(min_swap_bytes=0)) as smart:
        exact_steps(ref, model, _loss, _batches(4), smart=smart)
    assert swap_pass.swap_stats().swapped_out_bytes > 0


class CachedTable(nn.Module):
    """A checkpointed block with a lazily built cached table (as rotary caches are): the cache
    is made on the first call and sliced on every call, inside the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.block = LinearBlock()
        self.cache: torch.Tensor | None = None

    def _inner(self, x):
        if self.cache is None:
            self.cache = torch.linspace(0, 1, 64).repeat(HIDDEN, 1).t().contiguous()
        return self.block(x) * (1 + self.cache[: x.shape[1]])

    def forward(self, x):
        return checkpoint(self._inner, x, use_reentrant=False)


def test_checkpoint_with_cached_buffers():
    """torchtune test_offloading_works_with_view_ac_cached_buffers: the cache stays intact."""
    ref, model = twins(lambda: BlockStack(block=CachedTable))
    handle = swap_pass.enable_swap_layer_input(model)
    exact_steps(ref, model, _loss, _batches())
    assert moved() == 3 * 2 * 8 * HIDDEN * 4
    for layer, ref_layer in zip(model.layers, ref.layers, strict=True):
        assert torch.equal(layer.cache, ref_layer.cache)
    handle.remove()


def test_checkpoint_with_cached_buffers_smart():
    """The same, under SmartSwap."""
    ref, model = twins(lambda: BlockStack(block=CachedTable))
    with SmartSwap(model, memory_budget=0.5, config=SmartSwapConfig(min_swap_bytes=0)) as smart:
        exact_steps(ref, model, _loss, _batches(4), smart=smart)
    assert swap_pass.swap_stats().swapped_out_bytes > 0
    for layer, ref_layer in zip(model.layers, ref.layers, strict=True):
        assert torch.equal(layer.cache, ref_layer.cache)
