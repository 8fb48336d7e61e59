"""The bench's ``hf_offload`` row: Hugging Face transformers' own activation offloading.

transformers 5.23 and later have ``PreTrainedModel.activation_checkpointing_enable(offload=True)``:
each decoder layer runs under ``torch.utils.checkpoint`` inside
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so a layer's input goes to pinned host
memory in forward and comes back in backward, both copies on the compute stream. Releases that
have it only as ``gradient_checkpointing_enable(..., offload=True)`` are used through that name;
releases without an ``offload`` argument make the row a skip with the reason.

The row trains ``transformers.LlamaForCausalLM`` built to the bench model's sizes with the bench
model's weights (:func:`hf_llama_like`), on the same data, with the same loss: same model, HF's
code. Its losses are not compared bitwise with the other rows (other kernels: separate q/k/v and
gate/up projections).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from swap_pass.tools.bench.methods import BenchContext, MethodSkipped, Runner, require
from swap_pass.tools.models import LlamaStyleModel

__all__ = ["hf_checkpointing_enable", "hf_llama_like", "hf_offload", "hf_offload_switch",
           "logits_loss"]


def _hf_config(model: LlamaStyleModel) -> object:
    """A ``transformers.LlamaConfig`` with ``model``'s sizes (rotary base 10000, RMSNorm 1e-6)."""
    config_cls = require("transformers", "LlamaConfig")
    cfg = model.cfg
    return config_cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                      max_position_embeddings=cfg.max_seq_len, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")


def _hf_weights(model: LlamaStyleModel) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``LlamaForCausalLM``'s names (fused projections split)."""
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.qkv.weight.chunk(3, dim=0)  # output features: [q | k | v]
        gate, up = layer.mlp.gate_up.weight.chunk(2, dim=0)  # output features: [gate | up]
        out.update({
            p + "input_layernorm.weight": layer.input_norm.weight,
            p + "post_attention_layernorm.weight": layer.post_norm.weight,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.attn.o_proj.weight,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.mlp.down.weight,
        })
    return out


def hf_llama_like(model: LlamaStyleModel) -> nn.Module:
    """``transformers.LlamaForCausalLM`` with ``model``'s sizes, weights, device and dtype.

    Raises:
        MethodSkipped: transformers is not installed.
        RuntimeError: a weight of ``model`` has no place in the HF model, or the reverse.
    """
    causal_lm = require("transformers", "LlamaForCausalLM")
    weight = model.embed.weight
    with torch.device(weight.device):
        hf = causal_lm(_hf_config(model)).to(dtype=weight.dtype)
    weights = _hf_weights(model)
    names = {name for name, _ in hf.named_parameters()}
    if names != set(weights):
        raise RuntimeError(
            f"swap_pass.tools.bench.hf_llama_like: the HF model's parameters differ from the bench "
            f"model's (only in HF: {sorted(names - set(weights))[:4]}, only in the bench model: "
            f"{sorted(set(weights) - names)[:4]}). Each weight must have one place in both.")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(weights[name])
    return hf.train()


def logits_loss(hf: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(input_ids, labels) -> loss`` of an HF causal LM with the bench model's loss: cross entropy
    of the fp32 logits against labels that are already shifted (HF's own loss shifts again)."""

    def forward(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = hf(input_ids=input_ids).logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    return forward


# (method, keyword of its checkpoint arguments), newest first
_SWITCHES = (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
             ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"))


def hf_checkpointing_enable(model: nn.Module, *, use_reentrant: bool = False) -> None:
    """Turn on HF's activation checkpointing of ``model`` by the newest name its transformers has
    (``activation_checkpointing_enable``; ``gradient_checkpointing_enable``, deprecated in
    transformers 5, before it)."""
    for name, kwargs_name in _SWITCHES:
        method = getattr(model, name, None)
        if method is not None:
            method(**{kwargs_name: {"use_reentrant": use_reentrant}})
            return
    raise TypeError(f"{type(model).__name__} has no activation checkpointing switch "
                    f"({' or '.join(name for name, _ in _SWITCHES)})")


def hf_offload_switch(model_cls: type) -> tuple[str, str]:
    """The method of ``model_cls`` that turns on HF's checkpointing with offload, and the keyword
    of its checkpoint arguments.

    Raises:
        MethodSkipped: this transformers has no offloading argument (named with its version).
    """
    for name, kwargs_name in _SWITCHES:
        method = getattr(model_cls, name, None)
        if method is not None and "offload" in inspect.signature(method).parameters:
            return name, kwargs_name
    version = require("transformers", "__version__")
    raise MethodSkipped(
        f"transformers {version} has neither activation_checkpointing_enable(offload=...) nor an "
        "offload argument to gradient_checkpointing_enable (added in transformers 5.23)")


def _require_pinned_memory(device: torch.device) -> None:
    """HF's offload pins host memory (``save_on_cpu(pin_memory=True)``); a machine without an
    accelerator has no pinned allocator."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as err:
        raise MethodSkipped(
            f"HF's offload wraps each checkpoint in save_on_cpu(pin_memory=True), which fails "
            f"here (device {device.type}): {err}") from None


def hf_offload(model: nn.Module, ctx: BenchContext) -> Runner:
    """Build the ``hf_offload`` row: the bench model as HF Llama, HF checkpointing with offload."""
    if not isinstance(model, LlamaStyleModel):
        raise MethodSkipped(f"the HF offload row rebuilds swap_pass.tools.models.LlamaStyleModel "
                            f"as HF Llama; the bench model is a {type(model).__name__}")
    _require_pinned_memory(ctx.device)  # first: no transformers import where it cannot run
    name, kwargs_name = hf_offload_switch(require("transformers", "LlamaForCausalLM"))
    hf = hf_llama_like(model)
    getattr(hf, name)(**{kwargs_name: {"use_reentrant": False}}, offload=True)
    return Runner(forward=logits_loss(hf), module=hf)
