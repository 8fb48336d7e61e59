"""HF's ``activation_checkpointing_enable(offload=True)`` taken over by ``enable_swap_layer_input``.

HF's offload copies on the compute stream inside ``save_on_cpu(pin_memory=True)`` (a CPU build of
torch on a machine without an accelerator refuses the pinned copy). After
``enable_swap_layer_input`` the same blocks checkpoint without it and swap their input instead:
exact against HF's checkpointing without offload. On an accelerator HF's own offload runs too,
and is exact against the same reference."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import swap_pass
from tests.eager.helpers import assert_clean, assert_exact
from tests.eager.test_enable import L, _hf, _hf_step, _hf_step_freeing

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"),
    reason=f"transformers {transformers.__version__} has no activation_checkpointing_enable")


def _offloading(kind: str = "llama", device: torch.device | str = "cpu"):
    ref = _hf(kind).to(device)
    model = copy.deepcopy(ref)
    ref.activation_checkpointing_enable()
    model.activation_checkpointing_enable(offload=True)
    return ref, model


def _checkpoint_funcs(model):
    return [layer._gradient_checkpointing_func for layer in model.model.layers]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_offload_is_replaced_by_the_swap_exactly(kind, device):
    ref, model = _offloading(kind, device)
    hf_funcs = _checkpoint_funcs(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    kept = ids.clone()
    expected = _hf_step(ref, ids)
    if device.type != "cpu":  # HF's own offload: pinned host copies need an accelerator
        assert_exact(expected, _hf_step(model, ids))
        assert swap_pass.swap_stats().swapped_out_bytes == 0
    handle = swap_pass.enable_swap_layer_input(model)
    assert_exact(expected, _hf_step_freeing(model, handle.layers, ids))
    layer_input = 2 * 8 * 32 * 4
    assert swap_pass.swap_stats().swapped_out_bytes == (L - 1) * layer_input
    assert_clean()
    assert torch.equal(ids, kept)
    handle.remove()
    assert _checkpoint_funcs(model) == hf_funcs  # HF's offloading checkpoint is back


def test_blocks_left_out_by_the_filter_keep_hf_offload():
    _, model = _offloading()
    hf_funcs = _checkpoint_funcs(model)
    handle = swap_pass.enable_swap_layer_input(
        model, module_filter_fn=lambda m, fqn: not fqn.endswith("layers.1"))
    funcs = _checkpoint_funcs(model)
    assert funcs[1] is hf_funcs[1]
    assert funcs[0] is not hf_funcs[0] and funcs[2] is not hf_funcs[2]
    handle.remove()
    assert _checkpoint_funcs(model) == hf_funcs


# TrainingArguments' name for activation checkpointing: "activation_checkpointing" where the
# release has it ("gradient_checkpointing" is its deprecated alias there), else the old name.
_AC_ARG = next((f.name for f in dataclasses.fields(transformers.TrainingArguments)
                if f.name == "activation_checkpointing"), "gradient_checkpointing")


def _trainer_run(tmp_path, swap: bool):
    """Two steps of HF's ``Trainer`` with activation checkpointing, swap on or off."""
    model = _hf("llama")
    data = [{"input_ids": ids, "labels": ids} for ids in
            torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("swap" if swap else "plain")), max_steps=2,
        per_device_train_batch_size=2, **{_AC_ARG: True}, learning_rate=0.1,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    handle = swap_pass.enable_swap_layer_input(model) if swap else None  # the one line
    trainer.train()
    if handle is not None:
        handle.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_hf_trainer_with_activation_checkpointing_and_one_line_of_swap_pass(tmp_path):
    pytest.importorskip("accelerate", reason="HF's Trainer needs accelerate")
    expected = _trainer_run(tmp_path, swap=False)
    assert swap_pass.swap_stats().swapped_out_bytes == 0
    got = _trainer_run(tmp_path, swap=True)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 2 * (L - 1) * (2 * 8 * 32 * 4)  # two steps
    assert stats.host_bytes_in_use == 0


def _wrapped(wrap):
    """An HF Llama whose decoder layers are ``wrap(checkpoint_wrapper(layer))``, as accelerate's
    FSDP2 activation checkpointing builds them (transformers' own checkpointing off)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _hf("llama")
    model.config.use_cache = False  # a cache filled in forward would grow again in recompute
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = wrap(checkpoint_wrapper(layer, preserve_rng_state=False))
    return model


def _unwrapped_names(step):
    """A step's loss and gradients, the wrappers' ``_checkpoint_wrapped_module.`` left out of the
    names (the offloading model has one wrapper more)."""
    loss, grads = step
    return loss, {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}


def test_torch_offload_wrapper_is_replaced_by_the_swap_exactly(device):
    """accelerate's ``activation_checkpointing_offload``: ``offload_wrapper(checkpoint_wrapper(
    layer))`` per layer. Enabled, the layer input is swapped instead of ``save_on_cpu``'d; the
    gradients equal those of the same layers checkpointed without offload."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        OffloadWrapper,
        offload_wrapper,
    )

    ref = _wrapped(lambda m: m).to(device)
    model = _wrapped(offload_wrapper).to(device)
    model.load_state_dict(ref.state_dict())
    names = [n for n, _ in model.named_parameters()]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    expected = _hf_step(ref, ids)
    handle = swap_pass.enable_swap_layer_input(model)
    assert all(isinstance(block, OffloadWrapper) for block in model.model.layers)
    # the swap goes on the checkpointed module inside each wrapper
    assert handle.layers == [block._checkpoint_wrapped_module for block in model.model.layers]
    hooks_seen = []  # the saved-tensor hooks each checkpointed module is called under
    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    for layer in handle.layers:
        layer.register_forward_pre_hook(lambda *_: hooks_seen.append(top_hooks(False)))
    assert_exact(_unwrapped_names(expected),
                 _unwrapped_names(_hf_step_freeing(model, handle.layers, ids)))
    assert hooks_seen == [None] * L  # no save_on_cpu around them
    assert swap_pass.swap_stats().swapped_out_bytes == (L - 1) * 2 * 8 * 32 * 4
    assert_clean()
    handle.remove()
    assert [n for n, _ in model.named_parameters()] == names
    assert all("forward" not in vars(block) and "forward" not in vars(
        block._checkpoint_wrapped_module) for block in model.model.layers)
