"""TRL's ``activation_offloading=True`` served by swap_pass.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``RewardTrainer``) build
``trainer.maybe_activation_offload_context`` with ``get_act_offloading_ctx_manager`` when they are
constructed and enter it around every training step. One line before building the trainer puts
swap_pass's in its place::

    swap_pass.integrations.trl.serve_activation_offloading()
    trainer = SFTTrainer(model, args=SFTConfig(activation_offloading=True,
                                               gradient_checkpointing=True, ...), ...)
    trainer.train()

With checkpointing on, each checkpointed layer's input is swapped on side streams and nothing
else is copied; without it, TRL's own offloading runs and swap_pass says so once (Note: [What an
offloading flag becomes] in ``swap_pass/integrations/offload_flags.py``). Code that calls TRL's
function itself can call :func:`get_act_offloading_ctx_manager` here instead: same arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import ModuleType

from torch import nn

from swap_pass.config import SwapConfig
from swap_pass.integrations.offload_flags import LayerInputOffload

__all__ = ["ServedTrainers", "get_act_offloading_ctx_manager", "serve_activation_offloading"]

_HINT = "set gradient_checkpointing=True in the trainer's config (SFTConfig, DPOConfig, ...)"


def _trl_manager(model: nn.Module, **kwargs: object) -> AbstractContextManager:
    try:
        from trl.models import get_act_offloading_ctx_manager as trl_manager
    except ImportError as err:
        raise ImportError(
            "swap_pass.integrations.trl: this step goes to TRL's own activation offloading (the "
            f"warning before says why), and TRL does not import here ({err}). Install trl, or "
            "change what the warning names.") from err
    return trl_manager(model, **kwargs)


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
    *,
    config: SwapConfig | None = None,
    layers: Iterable[nn.Module] | None = None,
) -> LayerInputOffload:
    """TRL's ``get_act_offloading_ctx_manager``, served by swap_pass.

    Args:
        model: The model (a PEFT model, or one wrapped in ``.module``, is searched as it is).
        use_pin_memory: Host copies in pinned memory (``SwapConfig.pin_memory``).
        use_streams: Copies on side streams (``SwapConfig.use_streams``).
        min_offload_size: Smallest layer input, in bytes, that moves
            (``SwapConfig.min_swap_bytes``).
        max_fwd_stash_size: Passed to TRL's manager where the step is handed back; swap_pass
            bounds its copies in flight by ``SwapConfig.max_copies_in_flight``.
        warn_if_no_head: Passed to TRL's manager where the step is handed back.
        config: swap_pass's knobs; when given, the four above that map to it are not read.
        layers: The blocks, in the order they run. Default: found in ``model``.

    Returns:
        A context manager to enter around each training step, as TRL's.
    """
    if config is None:
        config = SwapConfig(pin_memory=use_pin_memory, use_streams=use_streams,
                            min_swap_bytes=min_offload_size)
    kwargs = dict(use_pin_memory=use_pin_memory, use_streams=use_streams,
                  min_offload_size=min_offload_size, max_fwd_stash_size=max_fwd_stash_size,
                  warn_if_no_head=warn_if_no_head)
    return LayerInputOffload(model, tool="TRL", theirs=lambda: _trl_manager(model, **kwargs),
                             checkpointing_hint=_HINT, config=config, layers=layers)


# The trainer modules that call TRL's get_act_offloading_ctx_manager by the name they imported.
_TRAINERS = ("trl.trainer.sft_trainer", "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer",
             "trl.trainer.reward_trainer")


class ServedTrainers:
    """The TRL trainer modules that build swap_pass's context; :meth:`remove` gives each its
    own function back (trainers already built keep the context they have).

    Attributes:
        modules: The names of the modules served.
    """

    def __init__(self, patched: list[tuple[ModuleType, object]]) -> None:
        self._patched = patched
        self.modules = [module.__name__ for module, _ in patched]

    def remove(self) -> None:
        for module, theirs in self._patched:
            module.get_act_offloading_ctx_manager = theirs
        self._patched = []

    def __enter__(self) -> ServedTrainers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ServedTrainers(modules={self.modules})"


def serve_activation_offloading() -> ServedTrainers:
    """Make TRL's trainers serve ``activation_offloading=True`` with swap_pass.

    Trainers built after this call (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``,
    ``RewardTrainer``) get :func:`get_act_offloading_ctx_manager` from this module in place of
    TRL's. A trainer built before keeps TRL's; give it swap_pass's with
    ``trainer.maybe_activation_offload_context = get_act_offloading_ctx_manager(trainer.model)``.

    Returns:
        The served modules; ``.remove()`` (or leaving ``with``) gives TRL's function back.

    Raises:
        ImportError: TRL does not import.
        RuntimeError: None of TRL's trainer modules calls ``get_act_offloading_ctx_manager``
            (a TRL release this integration does not know).
    """
    import importlib

    importlib.import_module("trl")  # ImportError with TRL's own reason
    patched = []
    for name in _TRAINERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        theirs = getattr(module, "get_act_offloading_ctx_manager", None)
        if theirs is not None and theirs is not get_act_offloading_ctx_manager:
            patched.append((module, theirs))
            module.get_act_offloading_ctx_manager = get_act_offloading_ctx_manager
    if not patched:
        raise RuntimeError(
            "swap_pass.integrations.trl.serve_activation_offloading: none of TRL's trainer "
            f"modules ({', '.join(_TRAINERS)}) builds its offloading context with "
            "get_act_offloading_ctx_manager in this TRL. Enter "
            "swap_pass.integrations.trl.get_act_offloading_ctx_manager(model) around the step "
            "yourself, or call swap_pass.enable_swap_layer_input(model).")
    return ServedTrainers(patched)
