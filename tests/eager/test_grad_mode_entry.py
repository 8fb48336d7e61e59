"""Layers that re-enable grad inside a checkpoint's no-grad forward (Megatron's TransformerLayer).

See Note: [Grad mode at layer entry] in swap_pass/eager/_protocol.py. The layer here runs its
residual add under ``torch.enable_grad()``, as Megatron's ``bias_dropout_add_exec_handler`` does,
so inside ``MegatronCheckpoint``'s no-grad forward its output still requires grad. Three
checkpoint layouts, each bitwise against the same model without swap, with the inputs that can
be swapped really freed after forward and nothing pending after backward:

* one checkpoint per layer (``recompute_num_layers=1``);
* two layers per checkpoint (``recompute_num_layers=2``): the inner layer's input is no saved
  tensor, and a guard on its region-local ``grad_fn`` would never fire;
* the first two layers checkpointed, the rest plain (Megatron's ``block`` method).
"""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass.runtime.freeing import in_backward
from swap_pass.tools.models import LlamaDecoderLayer, LlamaStyleModel
from tests.eager.helpers import CFG, MegatronCheckpoint, assert_clean, assert_exact, batch, twin


class GradEnablingLayer(LlamaDecoderLayer):
    """The tiny Llama layer with its last residual add under ``torch.enable_grad()``."""

    def forward(self, hidden_states, cos, sin):
        out = super().forward(hidden_states, cos, sin)
        with torch.enable_grad():
            return out + 0.0 * hidden_states  # a node whose graph exists even under no_grad


class ChunkedCheckpointModel(LlamaStyleModel):
    """Layers run in Megatron-style checkpoint regions.

    Args:
        layout: ``"uniform1"`` (one layer a region), ``"uniform2"`` (two layers a region) or
            ``"block2"`` (layers 0 and 1 each in a region, the rest plain).
    """

    def __init__(self, layout: str) -> None:
        super().__init__(CFG)
        self.layout = layout
        self.layers = torch.nn.ModuleList(GradEnablingLayer(CFG) for _ in range(CFG.num_layers))

    def _regions(self) -> list[tuple[list[int], bool]]:
        n = len(self.layers)
        if self.layout == "uniform1":
            return [([i], True) for i in range(n)]
        if self.layout == "uniform2":
            return [(list(range(i, min(i + 2, n))), True) for i in range(0, n, 2)]
        return [([i], i < 2) for i in range(n)]

    def forward(self, input_ids, labels=None):
        seq = input_ids.shape[1]
        cos, sin = self.cos_table[:seq], self.sin_table[:seq]
        h = self.embed(input_ids)
        for ids, checkpointed in self._regions():
            def run(x, *_rest, ids=ids):
                for i in ids:
                    x = self.layers[i](x, cos, sin)
                return x
            h = MegatronCheckpoint.apply(run, h) if checkpointed else run(h)
        logits = self.lm_head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 labels.reshape(-1))


def _step_watching(model, layers, data):
    """One step; returns (loss, grads) and whether each first-forward layer input was freed
    when forward ended."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, a: None if in_backward() else seen.append(a[0])) for layer in layers]
    model.zero_grad(set_to_none=True)
    loss = model(*data)
    freed = [x.untyped_storage().nbytes() == 0 for x in seen]
    for hook in hooks:
        hook.remove()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (loss.detach(), grads), freed


# Which layer inputs are freed after forward, by layout (4 layers; the last is never swapped).
# uniform2 under the generic enable: a region's first input is guarded by the next region's
# first call (whose input is the region's checkpoint output) and freed; the last region's, which
# no later call can guard, is kept (swap_pass.integrations.megatron enables region starts only).
FREED = {
    "uniform1": [True, True, True, False],
    "uniform2": [True, False, False, False],
    "block2": [True, True, True, False],
}


@pytest.mark.parametrize("layout", ["uniform1", "uniform2", "block2"])
def test_grad_enabling_layer_under_no_grad_checkpoint_is_exact(layout):
    torch.manual_seed(0)
    ref = ChunkedCheckpointModel(layout)
    model = twin(ref, lambda: ChunkedCheckpointModel(layout))
    data = batch()
    kept = [t.clone() for t in data]
    expected, _ = _step_watching(ref, ref.layers, data)
    handle = swap_pass.enable_swap_layer_input(model)
    got, freed = _step_watching(model, handle.layers, data)
    assert freed == FREED[layout]
    assert_exact(expected, got)
    assert_clean()
    assert all(torch.equal(a, b) for a, b in zip(kept, data, strict=True))
    assert_exact(expected, _step_watching(model, handle.layers, data)[0])  # a second step


def test_region_starts_only_free_every_saved_input():
    """Enabling only each region's first layer (what a framework integration does) frees every
    input the checkpoints keep, and stays exact."""
    torch.manual_seed(0)
    ref = ChunkedCheckpointModel("uniform2")
    model = twin(ref, lambda: ChunkedCheckpointModel("uniform2"))
    data = batch()
    expected, _ = _step_watching(ref, ref.layers, data)
    handle = swap_pass.enable_swap_layer_input(model, layers=list(model.layers)[::2])
    got, freed = _step_watching(model, handle.layers, data)
    assert freed == [True, False]  # region 0's input freed; the last region's is kept
    assert_exact(expected, got)
    assert swap_pass.swap_stats().swap_ins == 1
    assert_clean()
