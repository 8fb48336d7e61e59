"""torchtitan's llama3 debug model on CPU: no AC, full AC, selective AC, bitwise against the same
model without swap. ``model.layers`` is an ``nn.ModuleDict``: found by ``enable`` on its own, and
accepted as ``layers=``.

Needs torchtitan (the ``[torchtitan]`` extra; CI installs it in a separate environment and runs
this directory there). The CPU shims are in ``torchtitan_cpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations import torchtitan_cpu as tc

tc.import_shim()
pytest.importorskip("torchtitan.models.llama3",
                    reason="torchtitan is not installed (pip install 'swap-pass[torchtitan]')")

import swap_pass  # noqa: E402
from swap_pass.eager._layer_io import in_backward  # noqa: E402
from tests.eager.helpers import assert_clean, assert_exact  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
LAYERS = 4


def _freed_after_forward(model, layers, batch):
    """One step; also whether each block's first-forward input was freed when forward ended."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, a: None if in_backward() else seen.append(a[0])) for layer in layers]
    freed: list[bool] = []
    norm_hook = model.norm.register_forward_pre_hook(
        lambda m, a: freed.extend(x.untyped_storage().nbytes() == 0 for x in seen))
    try:
        return tc.train_step(model, batch), freed
    finally:
        norm_hook.remove()
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("ac,explicit", [("none", False), ("full", False), ("selective", False),
                                         ("full", True)],
                         ids=["none", "full", "selective", "full-layers=model.layers"])
def test_llama3_debug_model_bitwise_equal(ac, explicit):
    ref, model = tc.make_llama3_debug(n_layers=LAYERS), tc.make_llama3_debug(n_layers=LAYERS)
    tc.apply_ac(ref, ac)
    tc.apply_ac(model, ac)
    batch = tc.make_batch()
    kept = [t.clone() for t in batch]
    expected = tc.train_step(ref, batch)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers if explicit else None)
    assert handle.layers == list(model.layers.values())
    got, freed = _freed_after_forward(model, handle.layers, batch)
    assert freed == [True] * (LAYERS - 1) + [False]
    assert_exact(expected, got)
    assert swap_pass.swap_stats().swap_ins == LAYERS - 1
    assert_clean()
    assert all(torch.equal(a, b) for a, b in zip(kept, batch, strict=True))
    assert_exact(tc.train_step(ref, batch), tc.train_step(model, batch))  # a second step
    handle.remove()
    assert not any("forward" in vars(layer) for layer in model.layers.values())


def test_enable_before_ac_is_exact():
    """Swap enabled on the bare blocks, then torchtitan wraps them in CheckpointWrapper."""
    ref, model = tc.make_llama3_debug(n_layers=LAYERS), tc.make_llama3_debug(n_layers=LAYERS)
    handle = swap_pass.enable_swap_layer_input(model)
    tc.apply_ac(ref, "full")
    tc.apply_ac(model, "full")
    batch = tc.make_batch()
    got, freed = _freed_after_forward(model, handle.layers, batch)
    assert freed == [True] * (LAYERS - 1) + [False]
    assert_exact(tc.train_step(ref, batch), got)
    assert_clean()
