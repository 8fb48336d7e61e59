"""Blocks under accelerate's hooks (HF ``device_map``, ``dispatch_model``): the swap wrapper runs
inside the hook, after it moved the input to the block's device, so the tensor swapped is the one
the block saves. See Note: [Inside accelerate's hooks] in ``swap_pass/eager/enable.py``.

On one CPU the move is a clone made by a real accelerate ``ModelHook`` (what a move between two
devices makes: a new tensor); ``AlignDevicesHook`` runs too, as ``dispatch_model`` installs it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swap_pass
from swap_pass.eager.enable import _SwappedForward
from swap_pass.tools.models import LlamaStyleModel
from tests.eager.helpers import CFG, assert_exact, batch, train_step

hooks = pytest.importorskip("accelerate.hooks", reason="accelerate is not installed")


class _MoveInput(hooks.ModelHook):
    """Hands the block a new tensor, as a move to another device does."""

    def pre_forward(self, module, *args, **kwargs):
        return (args[0].clone(),) + args[1:], kwargs


def _received_inputs(model: LlamaStyleModel) -> list[torch.Tensor]:
    """What each block's forward really receives (its first norm's input)."""
    seen: list[torch.Tensor] = []
    for layer in model.layers:
        layer.input_norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    return seen


@pytest.mark.parametrize("order", ["hook_first", "enable_first"])
def test_the_tensor_a_block_receives_after_the_hook_is_swapped_and_exact(order):
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=True)
    ref = copy.deepcopy(model)
    data = batch(seed=0)
    expected = train_step(ref, data)
    handle = None
    if order == "enable_first":
        handle = swap_pass.enable_swap_layer_input(model)
    for layer in model.layers:
        hooks.add_hook_to_module(layer, hooks.SequentialHook(
            hooks.AlignDevicesHook(execution_device="cpu", io_same_device=True), _MoveInput()))
    if handle is None:
        handle = swap_pass.enable_swap_layer_input(model)
    seen = _received_inputs(model)
    model.zero_grad(set_to_none=True)
    loss = model(*data)
    received = seen[: len(model.layers)]
    assert sum(t.untyped_storage().nbytes() == 0 for t in received) >= len(received) - 2
    loss.backward()
    assert_exact(expected, (loss.detach(), {n: p.grad.clone()
                                           for n, p in model.named_parameters()}))
    handle.remove()
    model.zero_grad(set_to_none=True)
    assert_exact(expected, train_step(model, data))  # the hooks still run after remove()
    assert not any(isinstance(layer.__dict__.get(attr), _SwappedForward)
                   for layer in model.layers for attr in ("forward", "_old_forward"))
