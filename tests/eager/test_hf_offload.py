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
