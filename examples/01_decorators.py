"""MindSpeed's decorators on a hand-written Transformer layer (MindSpeed / Megatron style).

``@swap_layer_input_init_wrapper`` on ``__init__`` gives each layer instance a
``SwapLayerInputManager`` (in construction order); ``@swap_layer_input_forward_wrapper`` on
``forward`` swaps the layer's input (``hidden_states``, the ``hidden_states`` kwarg or
``args[0]``) to host memory after the layer ran, frees it once the copy is done, and brings it
back before backward (and the recompute) reads it. The last layer's input is never swapped.
Like Megatron's ``TransformerLayer``, ``forward`` returns ``(hidden_states, context)``::

    python examples/01_decorators.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass import swap_layer_input_forward_wrapper, swap_layer_input_init_wrapper

HIDDEN, LAYERS, BATCH, SEQ = 64, 6, 4, 128


class Block(nn.Module):
    """A pre-norm MLP block: ``forward(hidden_states) -> (hidden_states, None)``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, hidden_states: torch.Tensor):
        return hidden_states + self.down(F.gelu(self.up(self.norm(hidden_states)))), None


class SwapBlock(Block):
    """The same block with MindSpeed's decorators: no other change to the layer."""

    @swap_layer_input_init_wrapper
    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)

    @swap_layer_input_forward_wrapper
    def forward(self, hidden_states: torch.Tensor):
        return super().forward(hidden_states)


class Stack(nn.Module):
    def __init__(self, block_cls: type[Block]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block_cls(HIDDEN) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # full recompute: each layer keeps only its input
            x, _ = checkpoint(layer, x, use_reentrant=False)
        return self.head(x).pow(2).mean()


def train(block_cls: type[Block], steps: int = 3) -> list[torch.Tensor]:
    model = Stack(block_cls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(step),
                        requires_grad=True)
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> int:
    swap_pass.reset()
    expected = train(Block)
    got = train(SwapBlock)
    stats = swap_pass.swap_stats()
    managers = swap_pass.SwapLayerInputManager.manager_map["default"]
    assert len(managers) == LAYERS, managers
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (expected, got)
    assert stats.swap_outs >= LAYERS - 1 and stats.host_bytes_in_use == 0, stats
    print(f"{len(managers)} managers; swap-outs: {stats.swap_outs}; "
          f"bytes out/in: {stats.swapped_out_bytes}/{stats.swapped_in_bytes}")
    print("OK: losses bitwise equal with and without the decorators")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
