"""``enable_swap_layer_input``: HF Llama / Qwen2 / GPT-2 and nn.TransformerEncoder, no source
edit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass.eager import find_layer_blocks
from swap_pass.runtime.chain import SwapLayerInputManager
from swap_pass.runtime.freeing import in_backward
from swap_pass.tools.bench.hf_offload import hf_checkpointing_enable
from tests.eager.helpers import CFG, assert_clean, assert_exact, train_step

transformers = pytest.importorskip("transformers")

L = 3


def _hf(kind: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=64, num_attention_heads=2, attn_implementation="eager")
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=L, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, **common)
        return transformers.GPT2LMHeadModel(cfg)
    cls_cfg, cls_model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    cfg = cls_cfg(hidden_size=32, intermediate_size=48, num_hidden_layers=L, num_key_value_heads=2,
                  max_position_embeddings=64, **common)
    return cls_model(cfg)


def _hf_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _freed_after_forward(model, layers, run) -> list[bool]:
    """Run ``run()`` (forward only) and report which layer inputs lost their device storage."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, kw: None if in_backward() else seen.append(
            kw.get("hidden_states", a[0] if a else None)),
        with_kwargs=True) for layer in layers]
    out = run()
    for h in hooks:
        h.remove()
    return out, [x.untyped_storage().nbytes() == 0 for x in seen]


def _hf_step_freeing(model, layers, ids):
    """``_hf_step`` of a swapped model, asserting every layer input but the last was freed at
    the end of forward."""
    model.zero_grad(set_to_none=True)
    loss, freed = _freed_after_forward(model, layers, lambda: model(input_ids=ids, labels=ids).loss)
    assert freed == [True] * (len(layers) - 1) + [False]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("ckpt", [None, "reentrant", "non_reentrant"])
def test_hf_models_bitwise_equal(kind, ckpt, device):
    ref = _hf(kind).to(device)
    model = copy.deepcopy(ref)
    if ckpt is not None:
        for m in (ref, model):
            hf_checkpointing_enable(m, use_reentrant=ckpt == "reentrant")
    handle = swap_pass.enable_swap_layer_input(model)
    assert len(handle.layers) == L
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    expected = _hf_step(ref, ids)
    assert_exact(expected, _hf_step_freeing(model, handle.layers, ids))
    assert swap_pass.swap_stats().swap_ins == L - 1
    assert_clean()
    assert_exact(_hf_step(ref, ids), _hf_step(model, ids))  # a second step, same


def test_transformer_encoder_bitwise_equal():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model)
    assert handle.layers == list(model.layers)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(x.clone().requires_grad_()).square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    assert_exact(step(ref), step(model))
    assert swap_pass.swap_stats().swap_outs == 3
    assert_clean()


def test_finds_the_repeated_blocks():
    model = _hf("gpt2")
    assert find_layer_blocks(model) is model.transformer.h
    with pytest.raises(ValueError, match="no nn.ModuleList or nn.ModuleDict of two or more"):
        find_layer_blocks(nn.Sequential(nn.Linear(2, 2)))


class _DictLayers(nn.Module):
    """torchtitan's layout: blocks in an ``nn.ModuleDict`` keyed "0", "1", ..."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(4)})
        self.head = nn.Linear(16, 16)  # a single block elsewhere is never chosen

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x).square().mean()


@pytest.mark.parametrize("explicit", [False, True], ids=["found", "layers=ModuleDict"])
def test_module_dict_blocks_bitwise_equal(explicit):
    ref = _DictLayers()
    model = copy.deepcopy(ref)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers if explicit else None)
    assert handle.layers == list(model.layers.values())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    kept = x.clone()

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(x.requires_grad_(False))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    expected = step(ref)
    assert find_layer_blocks(model) is model.layers
    model.zero_grad(set_to_none=True)
    loss, freed = _freed_after_forward(model, handle.layers, lambda: model(x))
    assert freed[1:] == [True, True, False]  # inputs the blocks made are freed; not the last
    loss.backward()
    assert_exact(expected,
                 (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(x, kept)
    assert_clean()


def test_remove_restores_the_model_exactly():
    from swap_pass.tools.models import LlamaStyleModel, make_batch
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=True)
    before = {id(layer): dict(layer.__dict__) for layer in model.layers}
    model_dict = dict(model.__dict__)
    expected = train_step(model, make_batch(CFG, 2, 8))
    handle = swap_pass.enable_swap_layer_input(model)
    assert all("forward" in layer.__dict__ for layer in model.layers)
    assert_exact(expected, train_step(model, make_batch(CFG, 2, 8)))
    handle.remove()
    for layer in model.layers:
        assert layer.__dict__ == before[id(layer)]
        assert layer.forward.__func__ is type(layer).forward
    assert model.__dict__ == model_dict
    assert SwapLayerInputManager.managers(handle.module_tag) == []
    swap_pass.reset()
    assert_exact(expected, train_step(model, make_batch(CFG, 2, 8)))
    assert swap_pass.swap_stats().swap_outs == 0  # really off again
    handle.remove()  # idempotent
    with swap_pass.enable_swap_layer_input(model):  # and can be enabled again
        assert_exact(expected, train_step(model, make_batch(CFG, 2, 8)))
    assert "forward" not in model.layers[0].__dict__


def test_remove_keeps_a_preexisting_instance_forward():
    from swap_pass.tools.models import LlamaStyleModel
    model = LlamaStyleModel(CFG)
    custom = model.layers[0].forward
    model.layers[0].forward = custom
    swap_pass.enable_swap_layer_input(model).remove()
    assert model.layers[0].__dict__["forward"] is custom


def test_enable_twice_raises():
    from swap_pass.tools.models import LlamaStyleModel
    model = LlamaStyleModel(CFG)
    swap_pass.enable_swap_layer_input(model)
    with pytest.raises(RuntimeError, match="already enabled"):
        swap_pass.enable_swap_layer_input(model)
    with pytest.raises(RuntimeError, match="already has a swap manager"):
        swap_pass.enable_swap_layer_input(nn.Module(), layers=model.layers)
