"""The bench's rows for fine-tuning tools' activation offloading, against HF checkpointing.

Every row trains ``transformers.LlamaForCausalLM`` built from the bench model's sizes and weights
(:func:`~swap_pass.tools.bench.hf_offload.hf_llama_like`), on the same data, with the same loss:

* ``hf_recompute``: HF's activation checkpointing, no offload (the reference of the others);
* ``trl_offload`` / ``trl_offload_all``: TRL's ``get_act_offloading_ctx_manager`` around each
  forward, with and without checkpointing (without it, TRL copies every saved tensor);
* ``torchtune_offload``: torchtune's ``OffloadActivations`` with checkpointing;
* ``accelerate_offload``: accelerate's FSDP2 ``activation_checkpointing_offload`` layer wrapping
  (``offload_wrapper(checkpoint_wrapper(layer))``, the model unsharded);
* ``trl_swap``, ``torchtune_swap``, ``accelerate_swap``: the same flags served by swap_pass
  (``swap_pass.integrations.trl`` / ``torchtune``, and ``enable_swap_layer_input`` over the
  offload wrappers).

A tool that is not installed, or cannot run on the device (TRL's and torchtune's offloading need
an accelerator), is a row with the reason. The report's ``tools_section`` prints each row's
peak, the device memory swap_pass freed, and step and CPU time as ratios to HF checkpointing's
(each paired with the no-swap steps of the same run).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from swap_pass.tools.bench.hf_offload import hf_checkpointing_enable, hf_llama_like, logits_loss
from swap_pass.tools.bench.methods import (
    BenchContext,
    MethodSkipped,
    Runner,
    require,
    torchtune_offloading,
)
from swap_pass.tools.models import LlamaStyleModel

__all__ = ["BUILDS"]


def _hf(model: nn.Module, *, checkpointing: bool = True) -> nn.Module:
    if not isinstance(model, LlamaStyleModel):
        raise MethodSkipped(f"the offloading tools' rows rebuild swap_pass.tools.models."
                            f"LlamaStyleModel as HF Llama; the bench model is a "
                            f"{type(model).__name__}")
    hf = hf_llama_like(model)
    if checkpointing:
        hf_checkpointing_enable(hf)
    return hf


def _around_forward(hf: nn.Module, context: object,
                    close: Callable[[], None] = lambda: None) -> Runner:
    """A runner that enters ``context`` around each forward (as torchtune's recipes do; TRL's
    trainers keep it open over the backward too, where it installs nothing more)."""
    loss = logits_loss(hf)

    def forward(input_ids, labels):
        with context:
            return loss(input_ids, labels)

    return Runner(forward=forward, module=hf, close=close)


def hf_recompute(model: nn.Module, ctx: BenchContext) -> Runner:
    hf = _hf(model)
    return Runner(forward=logits_loss(hf), module=hf)


def _trl(model: nn.Module, ctx: BenchContext, checkpointing: bool) -> Runner:
    manager = require("trl.models", "get_act_offloading_ctx_manager")
    hf = _hf(model, checkpointing=checkpointing)
    try:
        offload = manager(hf)
    except Exception as err:  # TRL asks torch.accelerator for the device's streams
        raise MethodSkipped(f"TRL's OffloadActivations cannot be built on {ctx.device.type} "
                            f"({type(err).__name__}: {err})") from None
    return _around_forward(hf, offload)


def trl_offload(model: nn.Module, ctx: BenchContext) -> Runner:
    return _trl(model, ctx, checkpointing=True)


def trl_offload_all(model: nn.Module, ctx: BenchContext) -> Runner:
    return _trl(model, ctx, checkpointing=False)


def trl_swap(model: nn.Module, ctx: BenchContext) -> Runner:
    from swap_pass.integrations.trl import get_act_offloading_ctx_manager

    hf = _hf(model)
    served = get_act_offloading_ctx_manager(hf, config=ctx.swap_config)
    return _around_forward(hf, served, close=served.remove)


def torchtune_offload(model: nn.Module, ctx: BenchContext) -> Runner:
    offload = torchtune_offloading(ctx)  # first: skipped before an HF model is built
    return _around_forward(_hf(model), offload)


def torchtune_swap(model: nn.Module, ctx: BenchContext) -> Runner:
    from swap_pass.integrations.torchtune import get_act_offloading_ctx_manager

    hf = _hf(model)
    served = get_act_offloading_ctx_manager(hf, True, config=ctx.swap_config)
    return _around_forward(hf, served, close=served.remove)


def _offload_wrapped(model: nn.Module) -> nn.Module:
    """HF Llama with accelerate's FSDP2 activation checkpointing with offload: each decoder layer
    ``offload_wrapper(checkpoint_wrapper(layer, preserve_rng_state=False))``."""
    wrappers = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    checkpoint_wrapper = require(wrappers, "checkpoint_wrapper")
    offload_wrapper = require(wrappers, "offload_wrapper")
    hf = _hf(model, checkpointing=False)
    for i, layer in enumerate(hf.model.layers):
        hf.model.layers[i] = offload_wrapper(checkpoint_wrapper(layer, preserve_rng_state=False))
    return hf


def accelerate_offload(model: nn.Module, ctx: BenchContext) -> Runner:
    hf = _offload_wrapped(model)
    return Runner(forward=logits_loss(hf), module=hf)


def accelerate_swap(model: nn.Module, ctx: BenchContext) -> Runner:
    import swap_pass

    hf = _offload_wrapped(model)
    handle = swap_pass.enable_swap_layer_input(hf, config=ctx.swap_config)
    return Runner(forward=logits_loss(hf), module=hf, close=handle.remove)


BUILDS: dict[str, Callable[[nn.Module, BenchContext], Runner]] = {
    "hf_recompute": hf_recompute,
    "trl_offload": trl_offload,
    "trl_offload_all": trl_offload_all,
    "trl_swap": trl_swap,
    "torchtune_offload": torchtune_offload,
    "torchtune_swap": torchtune_swap,
    "accelerate_offload": accelerate_offload,
    "accelerate_swap": accelerate_swap,
}
