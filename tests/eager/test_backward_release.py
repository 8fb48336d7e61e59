"""Restored layer inputs are released as backward proceeds, not held to the end of the step."""

from __future__ import annotations

import weakref

import pytest
import torch

import swap_pass
from swap_pass.tools.models import LlamaConfig
from tests.eager.helpers import CheckpointedModel, batch

CFG8 = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=8, num_heads=2, intermediate_size=48)


@pytest.mark.parametrize("mode", ["none", "non_reentrant", "reentrant", "megatron"])
def test_layer_inputs_die_after_their_layer_backward(mode: str) -> None:
    torch.manual_seed(0)
    model = CheckpointedModel(CFG8, mode)
    swap_pass.enable_swap_layer_input(model)
    inputs: list[weakref.ref] = []
    recording = [True]  # only the first forward, not the recomputation in backward
    for layer in model.layers:
        layer.register_forward_pre_hook(
            lambda mod, args: inputs.append(weakref.ref(args[0])) if recording[0] else None)
    seen_alive: list[int] = []

    def count_alive(grad: torch.Tensor) -> None:  # layer 0's input grad: all layers are done
        seen_alive.append(sum(r() is not None and r().untyped_storage().nbytes() > 0
                              for r in inputs[2:]))

    loss = _forward_with_probe(model, count_alive)
    recording[0] = False
    assert len(inputs) == CFG8.num_layers
    assert swap_pass.swap_stats().swap_outs == CFG8.num_layers - 1  # swapping really happened
    loss.backward()
    # Layers 2..7 finished their backward before layer 0's input gradient exists: their inputs
    # must no longer hold device memory (before the fix, all six were alive until loss died).
    assert seen_alive == [0]


def _forward_with_probe(model, hook):
    ids, labels = batch(CFG8)
    seq = ids.shape[1]
    cos, sin = model.cos_table[:seq], model.sin_table[:seq]
    h = model.embed(ids)
    h.register_hook(hook)
    for layer in model.layers:
        h = model.run_layer(layer, h, cos, sin)
    logits = model.lm_head(model.norm(h)).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
