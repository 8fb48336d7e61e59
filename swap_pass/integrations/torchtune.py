"""torchtune's ``enable_activation_offloading: True`` served by swap_pass.

torchtune's recipes build ``self.activations_handling_ctx`` with
``torchtune.training.get_act_offloading_ctx_manager(model, enable_activation_offloading)`` and
enter it around each forward; they refuse offloading without activation checkpointing. In a
recipe (``tune cp`` gives an editable copy), one import puts swap_pass's in its place::

    from swap_pass.integrations.torchtune import get_act_offloading_ctx_manager
    ...
    self.activations_handling_ctx = get_act_offloading_ctx_manager(
        model, enable_activation_offloading)

Each checkpointed layer's input is then swapped on side streams and nothing else is copied; a
model whose layers are not checkpointed keeps torchtune's own offloading, said once (Note: [What
an offloading flag becomes] in ``swap_pass/integrations/offload_flags.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager

from torch import nn

from swap_pass.config import SwapConfig
from swap_pass.integrations.offload_flags import LayerInputOffload

__all__ = ["get_act_offloading_ctx_manager"]

_HINT = "set enable_activation_checkpointing: True in the recipe's config"


def _torchtune_manager(model: nn.Module) -> AbstractContextManager:
    try:
        from torchtune.training import get_act_offloading_ctx_manager as torchtune_manager
    except ImportError as err:
        raise ImportError(
            "swap_pass.integrations.torchtune: this step goes to torchtune's own activation "
            f"offloading (the warning before says why), and torchtune does not import here "
            f"({err}). Install torchtune, or change what the warning names.") from err
    return torchtune_manager(model, True)


def get_act_offloading_ctx_manager(
    model: nn.Module, enable_activation_offloading: bool, *,
    config: SwapConfig | None = None, layers: Iterable[nn.Module] | None = None,
) -> LayerInputOffload | contextlib.nullcontext:
    """torchtune's ``training.get_act_offloading_ctx_manager``, served by swap_pass.

    Args:
        model: The model, its layers wrapped by ``training.set_activation_checkpointing``.
        enable_activation_offloading: The recipe's flag; False gives a context that does nothing.
        config: swap_pass's knobs. Default: ``SwapConfig()``.
        layers: The blocks, in the order they run. Default: found in ``model``.

    Returns:
        A context manager to enter around each forward, as torchtune's.
    """
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    return LayerInputOffload(model, tool="torchtune", theirs=lambda: _torchtune_manager(model),
                             checkpointing_hint=_HINT, config=config, layers=layers)
