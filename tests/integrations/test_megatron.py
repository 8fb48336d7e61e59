"""megatron-core on CPU, one rank: every recompute mode, bitwise against Megatron without swap.

Needs megatron-core (the ``[megatron]`` extra; CI installs it in a separate environment and runs
this directory there). The CPU shims are in ``megatron_cpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

megatron_core = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'swap-pass[megatron]')")

import swap_pass  # noqa: E402
from swap_pass.integrations import megatron as sp_megatron  # noqa: E402
from swap_pass.runtime.freeing import in_backward  # noqa: E402
from tests.eager.helpers import assert_clean, assert_exact  # noqa: E402
from tests.integrations import megatron_cpu as mc  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

MODES = [("none", None, 1), ("selective", None, 1), ("full", "uniform", 1),
         ("full", "uniform", 2), ("full", "block", 1), ("full", "block", 2)]


@pytest.fixture(scope="module", autouse=True)
def _megatron_on_cpu():
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    with mc.cpu_shims():
        mc.init_parallel()
        yield


def _step_watching(model, layers, batch):
    """One step; also whether each watched layer's first-forward input was freed after forward."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, kw: None if in_backward() else seen.append(kw["hidden_states"]),
        with_kwargs=True) for layer in layers]
    try:
        original = model.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            forward.freed = [x.untyped_storage().nbytes() == 0 for x in seen]
            return out

        model.forward = forward
        loss, grads = mc.train_step(model, batch)
    finally:
        del model.forward
        for hook in hooks:
            hook.remove()
    return (loss, grads), forward.freed


@pytest.mark.parametrize("recompute,method,k", MODES,
                         ids=[f"{r}-{m}-{k}" if m else r for r, m, k in MODES])
def test_enable_is_exact_in_every_recompute_mode(recompute, method, k):
    cfg = mc.make_config(recompute=recompute, method=method, recompute_layers=k)
    ref, model = mc.make_gpt(cfg), mc.make_gpt(cfg)
    batch = mc.make_batch()
    kept = {n: t.clone() for n, t in batch.items()}
    expected = mc.train_step(ref, batch)
    handle = sp_megatron.enable(model)
    assert handle.layers == list(model.decoder.layers)[::k if method == "uniform" else 1]
    got, freed = _step_watching(model, handle.layers, batch)
    assert freed == [True] * (len(handle.layers) - 1) + [False]
    assert_exact(expected, got)
    assert swap_pass.swap_stats().swap_ins == len(handle.layers) - 1
    assert_clean()
    assert all(torch.equal(kept[n], batch[n]) for n in batch)
    assert_exact(mc.train_step(ref, batch), mc.train_step(model, batch))  # a second step
    assert_clean()
    handle.remove()
    assert not any(hasattr(layer, "swap_manager") for layer in model.decoder.layers)


def test_enable_module_filter_leaves_the_refused_layer_alone():
    cfg = mc.make_config(recompute="full", method="uniform", recompute_layers=1)
    ref, model = mc.make_gpt(cfg), mc.make_gpt(cfg)
    batch = mc.make_batch()
    handle = sp_megatron.enable(model, module_filter_fn=lambda m, fqn: fqn != "layers.1")
    layers = list(model.decoder.layers)
    assert handle.layers == [layers[0], *layers[2:]]
    got, freed = _step_watching(model, layers, batch)
    assert freed == [True, False, True, False]
    assert_exact(mc.train_step(ref, batch), got)
    assert_clean()
    handle.remove()


def test_generic_enable_on_gpt_model_full_recompute():
    """``enable_swap_layer_input(gpt)`` alone: Megatron's layers re-enable grad inside the
    checkpoint's no-grad forward; the protocol reads grad mode at layer entry."""
    cfg = mc.make_config(recompute="full", method="uniform", recompute_layers=1)
    ref, model = mc.make_gpt(cfg), mc.make_gpt(cfg)
    batch = mc.make_batch()
    handle = swap_pass.enable_swap_layer_input(model)
    assert handle.layers == list(model.decoder.layers)
    got, freed = _step_watching(model, handle.layers, batch)
    assert freed == [True, True, True, False]
    assert_exact(mc.train_step(ref, batch), got)
    assert_clean()


def test_decorated_layer_spec_full_recompute():
    """MindSpeed's way: its decorators on the layer class, through a layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = mc.make_config(recompute="full", method="uniform", recompute_layers=1)
    ref = mc.make_gpt(cfg)
    spec = sp_megatron.swap_layer_spec(get_gpt_layer_local_spec(), module_tag="test.spec")
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=mc.VOCAB,
                     max_sequence_length=mc.SEQ, position_embedding_type="rope")
    model.load_state_dict(ref.state_dict())
    assert [m.layer_idx for m in swap_pass.SwapLayerInputManager.managers("test.spec.vp0")] == [
        0, 1, 2, 3]
    batch = mc.make_batch()
    got, freed = _step_watching(model, list(model.decoder.layers), batch)
    assert freed == [True, True, True, False]
    assert_exact(mc.train_step(ref, batch), got)
    assert_clean()


def test_enable_rejects_a_model_without_transformer_block():
    with pytest.raises(TypeError, match="neither a TransformerBlock nor a model"):
        sp_megatron.enable(torch.nn.Linear(2, 2))


def test_mtp_layers_are_left_alone():
    """A GPTModel with a multi-token-prediction layer: only the decoder's layers are swapped,
    the MTP layer (which reads the decoder's output again) runs untouched; exact."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    cfg = mc.make_config(recompute="full", method="uniform", recompute_layers=1, mtp_num_layers=1)

    def build():
        torch.manual_seed(1234)
        mc.tensor_parallel_seed(1234)
        spec = get_gpt_layer_local_spec()
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=mc.VOCAB,
                        max_sequence_length=mc.SEQ, position_embedding_type="rope",
                        mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec,
                                                              use_transformer_engine=False))

    ref, model = build(), build()
    batch = mc.make_batch()
    handle = sp_megatron.enable(model)
    assert handle.layers == list(model.decoder.layers)
    assert not any(hasattr(m, "swap_manager") for m in model.mtp.modules())
    got, freed = _step_watching(model, handle.layers, batch)
    assert freed == [True, True, True, False]
    assert_exact(mc.train_step(ref, batch), got)
    assert_clean()
