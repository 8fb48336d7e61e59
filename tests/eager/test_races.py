"""Stream races of the eager path, shown under the CPU stream model and fixed.

Each test runs the same model with and without swap under ``swap_pass.testing.stream_model``
(side-stream copies queued, their destinations poisoned until waited for) and compares loss
and gradients bitwise. Without the fix the swapped run reads poison (NaN) or freed storage.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.models import LlamaDecoderLayer, LlamaStyleModel
from swap_pass.testing import stream_model
from tests.eager.helpers import CFG, assert_clean, assert_exact, batch, train_step, twin

pytestmark = pytest.mark.no_stream_model  # each test runs its own model, seeded


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


def _exact_under_model(factory, *, prefetch: bool, seed: int, steps: int = 2,
                       frees: bool = True) -> None:
    torch.manual_seed(0)
    ref_model = factory()
    model = twin(ref_model, factory)
    data = batch()
    handle = swap_pass.enable_swap_layer_input(
        model, config=swap_pass.SwapConfig(prefetch=prefetch))
    with stream_model(seed=seed) as sm:
        for _ in range(steps):  # a second step reuses the pooled host buffers
            ref = train_step(ref_model, data)
            got = train_step(model, data)
            assert_exact(ref, got)
    stats = swap_pass.swap_stats()
    assert stats.device_bytes_released == 0
    assert (stats.peak_device_bytes_released > 0) == frees
    assert not sm.hazards, sm.hazards
    handle.remove()
    assert_clean()


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("segment", [2, 4])
def test_checkpoint_spanning_swapped_layers_is_exact(segment, reentrant, prefetch):
    """The recompute of a segment reads its first layer's input before that layer's guard ran.

    Under reentrant checkpointing the layers inside a segment run under ``no_grad`` and only a
    segment's output carries a graph: the inner layers' inputs are never copied, and the input
    of every segment but the last is freed and restored, guarded by the next segment's input.
    With one segment around all layers nothing is freed.
    """
    frees = not reentrant or segment < CFG.num_layers
    for seed in range(2):
        _exact_under_model(lambda: SegmentCheckpointModel(CFG, segment, reentrant),
                           prefetch=prefetch, seed=seed, frees=frees)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("reader", ["alpha", "head"])
def test_op_outside_the_layer_reading_its_input_is_exact(reader, prefetch):
    """``alpha * x`` / a head on layer 1's input: their backward reads x before layer 1's does."""
    for seed in range(2):
        if reader == "alpha":
            _exact_under_model(lambda: ReadsLayerInputModel(CFG, reader), prefetch=prefetch,
                               seed=seed)
            continue
        # The warning is shown once per layer name, which holds the model's id(): the second
        # seed's model may take the first one's address. A reset lets each seed warn.
        swap_pass.reset()
        with pytest.warns(RuntimeWarning, match=r"layers\[1\] .* shares its storage"):
            _exact_under_model(lambda: ReadsLayerInputModel(CFG, reader), prefetch=prefetch,
                               seed=seed)


@pytest.mark.parametrize("sharing", ["returns_input", "fed_to_two_layers"])
def test_one_storage_in_two_layers_groups_is_exact(sharing):
    """Both layers' groups would hold one storage; the first wait_d2h would free it under the
    other."""

    def factory():
        model = SharedInputModel(CFG, sharing)
        model.layers = torch.nn.ModuleList(_Layer(CFG) for _ in range(CFG.num_layers))
        return model

    for seed in range(2):
        _exact_under_model(factory, prefetch=True, seed=seed)
