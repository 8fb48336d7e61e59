"""Fine-tuning tools' activation-offloading flags, served by swap_pass.

TRL (``activation_offloading=True`` in ``SFTConfig``, ``DPOConfig``, ``KTOConfig``,
``RewardConfig``) and torchtune (``enable_activation_offloading: True``) build one context manager
per model and enter it around each step: TRL around the forward and the backward, torchtune around
the forward. Theirs installs saved-tensor hooks that copy every saved tensor over a size to
pinned host memory (the output head's excepted). :class:`LayerInputOffload` is the context
manager swap_pass puts in its place; ``swap_pass.integrations.trl`` and
``swap_pass.integrations.torchtune`` build it with each tool's signature.

Note: [What an offloading flag becomes]
    With the model's layers activation-checkpointed (the case the tools recommend), what each
    layer keeps for backward is its input: the context enables the SwapLayerInput protocol on the
    layers (``enable_swap_layer_input``), so those inputs move on side streams, prefetched one
    layer ahead, and nothing else is copied; the tool's hooks are never entered.

    Without checkpointing the tool copies every saved tensor. swap_pass's layer protocol would move
    only the layer inputs, a small share of that, and saving the same bytes with swap_pass means a
    memory budget (``swap_pass.SmartSwap(model, memory_budget=...)``): a decision the flag does
    not carry. So the context hands the step to the tool's own manager, unchanged; it warns once,
    naming what to set, and counts every step it handed back in
    ``swap_stats().skips["handed_back"]``. A model in which no layer family is found, or whose
    layers ``enable_swap_layer_input`` refuses (a block compiled with ``nn.Module.compile``, say),
    is handed back the same way. The choice is made at the first ``with`` (TRL turns
    checkpointing on when training starts, after it built the context) and kept until
    :meth:`LayerInputOffload.remove`, after which the next ``with`` decides again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from swap_pass.config import SwapConfig
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.state import warn_once

__all__ = ["LayerInputOffload", "is_checkpointed"]


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` runs under activation checkpointing: HF's (``gradient_checkpointing``
    set on the layer) or torch's ``checkpoint_wrapper`` (torchtune, accelerate, torchtitan),
    offloading or not."""
    if getattr(block, "gradient_checkpointing", False) is True:
        return True
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except ImportError:  # torch built without torch.distributed
        return False
    return isinstance(block, ActivationWrapper)


class LayerInputOffload(AbstractContextManager):
    """A tool's activation-offloading context manager, served by swap_pass where the layers are
    checkpointed (Note: [What an offloading flag becomes]).

    Args:
        model: The model the tool offloads for.
        tool: The tool's name, for messages (``"TRL"``, ``"torchtune"``).
        theirs: Builds (or returns) the tool's own context manager; called only when the step is
            handed back.
        checkpointing_hint: How the user turns checkpointing on in that tool, for the warning
            (``"set ... in ..."``).
        config: Runtime knobs of the swap. Default: ``SwapConfig()``.
        layers: The blocks, in the order they run. Default: ``None``, found as
            ``enable_swap_layer_input`` finds them.

    Attributes:
        handle: The :class:`~swap_pass.SwapLayerInputHandle` serving the flag once decided, else
            None. A handle the user enabled before is used as it is (and left to the user).
        handed_back: The tool's own manager, entered in place of swap, once decided; else None.
    """

    def __init__(self, model: nn.Module, *, tool: str,
                 theirs: Callable[[], AbstractContextManager],
                 checkpointing_hint: str, config: SwapConfig | None = None,
                 layers: Iterable[nn.Module] | None = None) -> None:
        self.model = model
        self.tool = tool
        self._theirs = theirs
        self._hint = checkpointing_hint
        self._config = config
        self._layers = None if layers is None else list(layers)
        self.handle: Any = None
        self.handed_back: AbstractContextManager | None = None
        self._owns_handle = False

    def __enter__(self) -> LayerInputOffload:
        if self.handle is None and self.handed_back is None:
            self._decide()
        if self.handed_back is not None:
            record_skip(SkipReason.HANDED_BACK, 0, warn=False)
            self.handed_back.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool | None:
        if self.handed_back is not None:
            return self.handed_back.__exit__(*exc)
        return None

    def remove(self) -> None:
        """Undo what the context enabled on the model (a handle the user enabled stays); a later
        ``with`` decides again."""
        if self._owns_handle and self.handle.active:
            self.handle.remove()
        self.handle, self.handed_back, self._owns_handle = None, None, False

    def _decide(self) -> None:
        from swap_pass.eager.enable import _HANDLE_ATTR, enable_swap_layer_input, find_layer_blocks

        existing = self.model.__dict__.get(_HANDLE_ATTR)
        if existing is not None:
            self.handle = existing
            return
        try:
            found = find_layer_blocks(self.model) if self._layers is None else self._layers
        except ValueError:
            self._hand_back(f"swap_pass found no layer family (a list of same-class blocks) in "
                            f"{type(self.model).__name__}",
                            f"pass layers=[...] to swap_pass's {self.tool} integration")
            return
        blocks = list(found.values() if isinstance(found, nn.ModuleDict) else found)
        plain = sum(not is_checkpointed(b) for b in blocks)
        if plain:
            self._hand_back(f"{plain} of its {len(blocks)} layers ({type(blocks[0]).__name__}) "
                            "are not activation-checkpointed", self._hint)
            return
        try:
            self.handle = enable_swap_layer_input(self.model, layers=blocks, config=self._config)
        except (RuntimeError, ValueError) as err:  # refused, the model unchanged
            self._hand_back(f"swap_pass cannot swap its layers ({err})", "change what that names")
            return
        self._owns_handle = True

    def _hand_back(self, why: str, what_to_set: str) -> None:
        warn_once("handed_back", f"{id(self.model):x}", (
            f"swap_pass: {self.tool}'s activation offloading of this {type(self.model).__name__} "
            f"stays {self.tool}'s own (every saved tensor over its size copied to the host): "
            f"{why}. swap_pass swaps the inputs of checkpointed layers; to have it serve this "
            f"flag, {what_to_set}, or use swap_pass.SmartSwap(model, memory_budget=...) "
            "for a memory budget without checkpointing. swap_stats().skips['handed_back'] "
            "counts these steps."), stacklevel=4)
        self.handed_back = self._theirs()  # after the warning: it may fail as the tool does
