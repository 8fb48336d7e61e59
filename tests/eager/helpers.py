"""Shared pieces of the eager tests: decorated layers, checkpoint styles, exact comparisons."""

from __future__ import annotations

import copy

import torch
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.runtime.chain import SwapLayerInputManager
from swap_pass.tools.models import LlamaConfig, LlamaDecoderLayer, LlamaStyleModel, make_batch

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=2, intermediate_size=48)


class SwapLlamaLayer(LlamaDecoderLayer):
    """The tiny Llama layer, decorated the MindSpeed way (tag kept per test model)."""

    swap_module_tag = "tests.eager"

    @swap_pass.swap_layer_input_init_wrapper
    def __init__(self, cfg: LlamaConfig, *, is_mtp: bool = False) -> None:
        self.is_mtp = is_mtp
        super().__init__(cfg)

    @swap_pass.swap_layer_input_forward_wrapper
    def forward(self, hidden_states, cos, sin):
        return super().forward(hidden_states, cos, sin)


class MegatronCheckpoint(torch.autograd.Function):
    """Megatron's convention: first forward under no_grad keeps only the input; backward reruns."""

    @staticmethod
    def forward(ctx, run, hidden_states, *rest):
        ctx.run, ctx.rest = run, rest
        ctx.save_for_backward(hidden_states)
        with torch.no_grad():
            return run(hidden_states, *rest)

    @staticmethod
    def backward(ctx, grad):
        (hidden_states,) = ctx.saved_tensors
        x = hidden_states.detach().requires_grad_(hidden_states.requires_grad)
        with torch.enable_grad():
            out = ctx.run(x, *ctx.rest)
        torch.autograd.backward(out, grad)
        return (None, x.grad) + (None,) * len(ctx.rest)


class CheckpointedModel(LlamaStyleModel):
    """LlamaStyleModel whose layers run under a chosen activation-checkpoint style.

    Args:
        mode: ``"none"``, ``"non_reentrant"``, ``"reentrant"`` or ``"megatron"``.
    """

    def __init__(self, cfg: LlamaConfig, mode: str, layer_cls=LlamaDecoderLayer) -> None:
        super().__init__(cfg)
        self.mode = mode
        self.layers = torch.nn.ModuleList(layer_cls(cfg) for _ in range(cfg.num_layers))

    def run_layer(self, layer, h, cos, sin):
        if self.mode == "none" or not torch.is_grad_enabled():
            return layer(h, cos, sin)
        if self.mode == "megatron":
            return MegatronCheckpoint.apply(layer, h, cos, sin)
        return checkpoint(layer, h, cos, sin, use_reentrant=self.mode == "reentrant")

    def forward(self, input_ids, labels=None):
        seq = input_ids.shape[1]
        cos, sin = self.cos_table[:seq], self.sin_table[:seq]
        h = self.embed(input_ids)
        for layer in self.layers:
            h = self.run_layer(layer, h, cos, sin)
        logits = self.lm_head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 labels.reshape(-1))


def twin(model: torch.nn.Module, factory) -> torch.nn.Module:
    """A second model from ``factory()`` with ``model``'s exact weights."""
    other = factory()
    other.load_state_dict(copy.deepcopy(model.state_dict()))
    return other


def train_step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every parameter gradient of one forward/backward."""
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_exact(ref, got) -> None:
    """Loss and gradients bitwise equal (``torch.equal``), same parameter set."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert torch.equal(ref_loss, loss), (ref_loss.item(), loss.item())
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert torch.equal(ref_grads[name], grads[name]), name


def pending_entries(tag: str | None = None) -> int:
    """Groups still in some manager's FIFO (all tags, or one)."""
    tags = [tag] if tag else list(SwapLayerInputManager.manager_map)
    return sum(len(m.batch_stack) for t in tags for m in SwapLayerInputManager.managers(t))


def assert_clean(tag: str | None = None) -> None:
    """No pending group and no host byte in use."""
    assert pending_entries(tag) == 0
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def batch(cfg: LlamaConfig = CFG, *, seed: int = 0, b: int = 2, s: int = 8, device="cpu"):
    return make_batch(cfg, b, s, seed=seed, device=device)
