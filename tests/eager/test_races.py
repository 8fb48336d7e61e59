"""Stream races of the eager path, each fixed.

Each test runs the same model with and without swap on every device present (``device``) and
compares loss and gradients bitwise. On the test accelerator (in its pass) side-stream copies run
late and freed blocks are poisoned: without the fix the swapped run reads poison (NaN) or a freed
block, and an unordered read, write or free it counts fails the test at teardown
(``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.tools.models import LlamaDecoderLayer, LlamaStyleModel
from tests.eager.helpers import CFG, assert_clean, assert_exact, batch, train_step, twin


class SegmentCheckpointModel(LlamaStyleModel):
    """Megatron's uniform recompute: one checkpoint around ``segment`` consecutive layers."""

    def __init__(self, cfg, segment: int, reentrant: bool) -> None:
        super().__init__(cfg)
        self.segment, self.reentrant = segment, reentrant

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        cos, sin = self.cos_table[:seq], self.sin_table[:seq]
        h = self.embed(input_ids)
        for i in range(0, len(self.layers), self.segment):
            chunk = list(self.layers[i:i + self.segment])
            h = checkpoint(_run_chunk, chunk, h, cos, sin, use_reentrant=self.reentrant)
        logits = self.lm_head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 labels.reshape(-1))


def _run_chunk(chunk, h, cos, sin):
    for layer in chunk:
        h = layer(h, cos, sin)
    return h


class ReadsLayerInputModel(LlamaStyleModel):
    """An op outside layer 1 reads its input after it ran: ``alpha * x`` or a head on it."""

    def __init__(self, cfg, reader: str) -> None:
        super().__init__(cfg)
        self.reader = reader
        self.alpha = torch.nn.Parameter(torch.tensor(0.5))
        self.aux_head = torch.nn.Linear(cfg.hidden_size, 4)

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        cos, sin = self.cos_table[:seq], self.sin_table[:seq]
        h = self.embed(input_ids)
        extra = None
        for idx, layer in enumerate(self.layers):
            x = h
            h = layer(h, cos, sin)
            if idx == 1:  # layer 1 ran; its input x is swapped out and freed by layer 2
                extra = (self.alpha * x).pow(2).mean() if self.reader == "alpha" else \
                    self.aux_head(x).float().pow(2).mean()
        logits = self.lm_head(self.norm(h)).float()
        ce = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                               labels.reshape(-1))
        return ce + extra


class SharedInputModel(LlamaStyleModel):
    """One storage in two layers' groups: layer 1 returns its input, or h feeds layers 1 and 2."""

    def __init__(self, cfg, sharing: str) -> None:
        super().__init__(cfg)
        self.sharing = sharing

    def forward(self, input_ids, labels):
        seq = input_ids.shape[1]
        cos, sin = self.cos_table[:seq], self.sin_table[:seq]
        h = self.layers[0](self.embed(input_ids), cos, sin)
        if self.sharing == "returns_input":
            h = self.layers[1](h, cos, sin, passthrough=True)
            h = self.layers[2](h, cos, sin)
        else:  # the same hidden states into two layers, summed
            h = self.layers[1](h, cos, sin) + self.layers[2](h, cos, sin)
        h = self.layers[3](h, cos, sin)
        logits = self.lm_head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 labels.reshape(-1))


class _Layer(LlamaDecoderLayer):
    def forward(self, hidden_states, cos, sin, passthrough=False):
        return hidden_states if passthrough else super().forward(hidden_states, cos, sin)


def _exact(factory, device, *, prefetch: bool, steps: int = 2, frees: bool = True) -> None:
    torch.manual_seed(0)
    ref_model = factory().to(device)
    model = twin(ref_model, factory).to(device)
    data = batch(device=device)
    handle = swap_pass.enable_swap_layer_input(
        model, config=swap_pass.SwapConfig(prefetch=prefetch))
    for _ in range(steps):  # a second step reuses the pooled host buffers
        ref = train_step(ref_model, data)
        got = train_step(model, data)
        assert_exact(ref, got)
    stats = swap_pass.swap_stats()
    assert stats.device_bytes_released == 0
    assert (stats.peak_device_bytes_released > 0) == frees
    handle.remove()
    assert_clean()


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("segment", [2, 4])
def test_checkpoint_spanning_swapped_layers_is_exact(segment, reentrant, prefetch, device):
    """The recompute of a segment reads its first layer's input before that layer's guard ran.

    Under reentrant checkpointing the layers inside a segment run under ``no_grad`` and only a
    segment's output carries a graph: the inner layers' inputs are never copied, and the input
    of every segment but the last is freed and restored, guarded by the next segment's input.
    With one segment around all layers nothing is freed.
    """
    frees = not reentrant or segment < CFG.num_layers
    _exact(lambda: SegmentCheckpointModel(CFG, segment, reentrant), device, prefetch=prefetch,
           frees=frees)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("reader", ["alpha", "head"])
def test_op_outside_the_layer_reading_its_input_is_exact(reader, prefetch, device):
    """``alpha * x`` / a head on layer 1's input: their backward reads x before layer 1's does."""
    if reader == "alpha":
        _exact(lambda: ReadsLayerInputModel(CFG, reader), device, prefetch=prefetch)
        return
    with pytest.warns(RuntimeWarning, match=r"layers\[1\] .* shares its storage"):
        _exact(lambda: ReadsLayerInputModel(CFG, reader), device, prefetch=prefetch)


@pytest.mark.parametrize("sharing", ["returns_input", "fed_to_two_layers"])
def test_one_storage_in_two_layers_groups_is_exact(sharing, device):
    """Both layers' groups would hold one storage; the first wait_d2h would free it under the
    other."""

    def factory():
        model = SharedInputModel(CFG, sharing)
        model.layers = torch.nn.ModuleList(_Layer(CFG) for _ in range(CFG.num_layers))
        return model

    _exact(factory, device, prefetch=True)
