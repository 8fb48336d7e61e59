"""Shared pieces of the reliability tests: the tiny model pair and a probe of layer inputs."""

from __future__ import annotations

import torch

from swap_pass.tools.models import LlamaConfig, LlamaStyleModel
from tests.eager.helpers import twin

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=2, intermediate_size=48)
SWAPPED_LAYERS = CFG.num_layers - 1  # the last layer's input is never swapped


def input_bytes(b: int, s: int, cfg: LlamaConfig = CFG) -> int:
    """Bytes of one layer input (float32 hidden states) for a ``(b, s)`` batch."""
    return b * s * cfg.hidden_size * 4


def sgd(model: torch.nn.Module, lr: float = 0.1) -> None:
    """A plain SGD update from the gradients in place (the same on both models of a pair)."""
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def model_pair(recompute: bool, cfg: LlamaConfig = CFG, seed: int = 0, device="cpu"):
    """A no-swap reference and a twin with the same weights (swap is enabled by the caller)."""
    torch.manual_seed(seed)
    ref = LlamaStyleModel(cfg, recompute=recompute).to(device)
    return ref, twin(ref, lambda: LlamaStyleModel(cfg, recompute=recompute).to(device))


class InputProbe:
    """Records each layer's ``hidden_states`` (and a clone of its values) during a forward.

    A forward pre-hook sees the tensor the layer (and so the swap) receives; the probe keeps a
    reference, so the test can check ``untyped_storage().nbytes()`` after the forward. Hooks are
    removed on exit, before backward's recomputation calls the layers again.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = list(model.layers)
        self.inputs: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._handles: list = []

    def _hook(self, module: torch.nn.Module, args: tuple) -> None:
        self.inputs.append(args[0])
        self.values.append(args[0].detach().clone())

    def __enter__(self) -> InputProbe:
        self._handles = [layer.register_forward_pre_hook(self._hook) for layer in self.layers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def resident_bytes(self) -> list[int]:
        """Device bytes each recorded input's storage holds now (0 = freed by the swap)."""
        return [t.untyped_storage().nbytes() for t in self.inputs]

    def values_intact(self) -> bool:
        """Whether every recorded input holds its data (bitwise) again."""
        return all(torch.equal(t, v) for t, v in zip(self.inputs, self.values, strict=True))
