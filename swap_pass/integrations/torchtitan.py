"""torchtitan: swap each Transformer block's input, switched on by a model converter.

torchtitan 0.3.0 transforms a model's configuration with ``ModelConfigConverter`` s (its Float8,
MXFP8 and LoRA converters), listed where a config function picks the model::

    from swap_pass.integrations.torchtitan import SwapLayerInputConverter
    from torchtitan.models.llama3 import model_registry

    config.model_spec = model_registry(
        "8B", converters=[SwapLayerInputConverter.Config(prefetch_layers=2)])
    config.training.disable_cuda_graphs = True   # see Note: [CUDA graphs]

and the trainer builds the model from the converted configuration. The converter returns the
model's configuration as a subclass of its own class that carries the converter's settings
(``to_dict()`` shows them under ``"swap_layer_input"``); what that subclass builds is the usual
model with swap armed on it. This module imports torchtitan; ``swap_pass`` itself does not.

Note: [Enabled at the first forward]
    The trainer builds the model on the meta device, then ``parallelize_fn`` applies tensor
    parallel, activation checkpointing (which wraps each block in ``checkpoint_wrapper``),
    torchtitan's compile and FSDP, then materializes the weights. Swap is armed at build time as
    a forward pre-hook on the model and enabled by the model's first forward, with
    :func:`swap_pass.enable_swap_layer_input` on ``model.layers`` as parallelized: the same call,
    on the same modules, as a user's own call after ``parallelize_fn`` (so blocks compiled by
    torchtitan's ``compile.enable`` are refused there, naming ``swap_pass.compile_layers``). A
    pipeline stage (a copy of the model that keeps some of the layers) enables itself on its
    own layers; a stage without layers swaps nothing.

Note: [CUDA graphs]
    torchtitan 0.3.0 captures each step's forward and backward in a CUDA graph unless
    ``training.disable_cuda_graphs`` is set. Copies and frees cannot be captured: while a stream
    captures, swap_pass keeps every layer input on the device (counted under
    ``swap_stats().skipped``), so the replayed steps swap nothing. Set
    ``training.disable_cuda_graphs = True`` (``--training.disable_cuda_graphs``) with swap.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

from torch import nn

from swap_pass.config import SwapConfig
from swap_pass.eager.enable import (
    SwapLayerInputHandle,
    enable_swap_layer_input,
    find_layer_blocks,
)
from swap_pass.state import torchtitan_config_classes as _config_classes

try:
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as err:  # pragma: no cover - exercised without torchtitan only
    raise ImportError(
        "swap_pass.integrations.torchtitan needs torchtitan 0.3.0 "
        "(pip install 'swap-pass[torchtitan]'); swap_pass itself imports without it."
    ) from err

__all__ = ["DeferredSwap", "SwapLayerInputConverter", "deferred_swap"]

_API = "integrations.torchtitan"
_STATE_ATTR = "_swap_pass_torchtitan"
_FIELD = "swap_layer_input"


def _swap_config(self) -> SwapConfig:
    """The :class:`swap_pass.SwapConfig` these knobs make (validated)."""
    return SwapConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SwapConfig)})


def _converter_config() -> type:
    """The converter's ``Config``: every :class:`swap_pass.SwapConfig` field (same name, type and
    default; an enum default as its value, which torchtitan's command line parses) and
    ``filter_fqns``: blocks whose name in the model matches one of these ``fnmatch`` patterns
    (e.g. ``"layers.0"``, ``"layers.1*"``) keep their input on the device."""
    hints = typing.get_type_hints(SwapConfig)
    fields = []
    for f in dataclasses.fields(SwapConfig):
        kind, default = hints[f.name], f.default
        if isinstance(default, enum.Enum):
            kind, default = type(default.value), default.value
        fields.append((f.name, kind, field(default=default)))
    fields.append(("filter_fqns", list[str], field(default_factory=list)))
    return dataclasses.make_dataclass(
        "Config", fields, bases=(ModelConfigConverter.Config,), kw_only=True, slots=True,
        namespace={"swap_config": _swap_config, "__qualname__": "SwapLayerInputConverter.Config",
                   "__module__": __name__,
                   "__doc__": "SwapConfig's knobs and ``filter_fqns``: see ``_converter_config``."})


class SwapLayerInputConverter(ModelConfigConverter):
    """torchtitan model converter: the built model swaps each block's input to host memory.

    Its ``Config`` holds :class:`swap_pass.SwapConfig`'s knobs (same names, same defaults) and
    ``filter_fqns``; ``Config().build().convert(model_config)`` returns the converted model
    configuration (torchtitan's ``model_registry(flavor, converters=[...])`` does this).
    List it after the converters that replace modules (quantization, LoRA).
    """

    Config = _converter_config()

    def __init__(self, config: Config) -> None:
        self.config = config
        config.swap_config()  # a bad knob fails here, where the configuration is converted
        patterns = config.filter_fqns
        if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
            raise TypeError(
                f"swap_pass.{_API}: filter_fqns={config.filter_fqns!r} must be a list of "
                "fnmatch patterns (str) naming blocks, e.g. ['layers.0']."
            )

    def convert(self, model_config: Any) -> Any:
        """``model_config`` as an instance of a subclass of its class that carries this
        converter's ``Config`` and arms swap on the model it builds.

        Raises:
            ValueError: ``model_config`` was converted already.
        """
        if isinstance(getattr(model_config, _FIELD, None), SwapLayerInputConverter.Config):
            raise ValueError(
                f"swap_pass.{_API}: {type(model_config).__qualname__} is converted for swap "
                "already; list SwapLayerInputConverter once."
            )
        cls = _swap_config_class(type(model_config))
        kept = {f.name: getattr(model_config, f.name)
                for f in dataclasses.fields(model_config) if f.init}
        return cls(**kept, **{_FIELD: self.config})


def _swap_config_class(base: type) -> type:
    """The subclass of the model configuration class ``base`` that arms swap on what it builds
    (one per ``base``)."""
    cls = _config_classes.get(base)
    if cls is not None:
        return cls

    @dataclass(kw_only=True, slots=True)
    class SwapModelConfig(base):  # type: ignore[misc, valid-type]
        swap_layer_input: SwapLayerInputConverter.Config = field(
            default_factory=SwapLayerInputConverter.Config)

        def build(self, **kwargs: Any) -> nn.Module:
            # slots=True: no zero-argument super() in this class
            model = base.build(self, **kwargs)
            _arm(model, self.swap_layer_input)
            return model

    SwapModelConfig.__name__ = "SwapLayerInput" + base.__name__
    SwapModelConfig.__qualname__ = "SwapLayerInput" + base.__qualname__.replace(".", "")
    _config_classes[base] = SwapModelConfig
    return SwapModelConfig


class DeferredSwap:
    """Swap armed on a model built from a converted configuration (Note: [Enabled at the first
    forward]); ``deferred_swap(model)`` returns it.

    Attributes:
        model: The model it is armed on.
        config: The runtime knobs.
        filter_fqns: Patterns of block names that keep their input.
        handle: The :class:`swap_pass.SwapLayerInputHandle` made by the first forward; None
            before it and after :meth:`remove`.
    """

    def __init__(self, model: nn.Module, config: SwapConfig, filter_fqns: list[str]) -> None:
        self.model = model  # a copy of the model (deepcopy) gets a copy of this, on itself
        self.config = config
        self.filter_fqns = list(filter_fqns)
        self.handle: SwapLayerInputHandle | None = None
        self.removed = False

    @property
    def layers(self) -> list[nn.Module]:
        """The swapped blocks (none before the first forward)."""
        return self.handle.layers if self.handle is not None else []

    @property
    def managers(self) -> list[Any]:
        """One manager per swapped block (none before the first forward)."""
        return self.handle.managers if self.handle is not None else []

    def _keep(self, module: nn.Module, fqn: str) -> bool:
        return not any(fnmatch(fqn, pattern) for pattern in self.filter_fqns)

    def __call__(self, model: nn.Module, args: tuple) -> None:
        """The model's forward pre-hook: enable swap on the first call.

        Raises:
            ValueError: A pattern of ``filter_fqns`` names none of the blocks.
        """
        if self.handle is not None or self.removed:
            return
        layers = getattr(model, "layers", None)
        if isinstance(layers, nn.ModuleDict) and len(layers) == 0:
            return  # a pipeline stage without layers: nothing to swap
        found = find_layer_blocks(model) if not isinstance(layers, nn.ModuleDict) else layers
        blocks = list(found.values() if isinstance(found, nn.ModuleDict) else found)
        self._check_patterns(model, blocks)
        self.handle = enable_swap_layer_input(
            model, layers=blocks, config=self.config,
            module_filter_fn=self._keep if self.filter_fqns else None)

    def _check_patterns(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        names = {id(m): fqn for fqn, m in model.named_modules(remove_duplicate=False)}
        fqns = [names.get(id(block), "") for block in blocks]
        unmatched = [p for p in self.filter_fqns if not any(fnmatch(f, p) for f in fqns)]
        if unmatched:
            raise ValueError(
                f"swap_pass.{_API}: filter_fqns {unmatched} name none of the blocks "
                f"({', '.join(fqns[:4])}{', ...' if len(fqns) > 4 else ''}). Each pattern must "
                "match the name of a block in the model (fnmatch), e.g. 'layers.0'."
            )

    @property
    def active(self) -> bool:
        """True until :meth:`remove` ran (also before the first forward)."""
        return not self.removed

    def remove(self) -> None:
        """Undo swap on the model: its blocks get their ``forward`` back and its pre-hook is
        dropped. Safe at any point, also between a forward and its backward (as
        ``SwapLayerInputHandle.remove()``); a second call does nothing."""
        self.removed = True
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        hooks = self.model._forward_pre_hooks
        for key in [k for k, hook in hooks.items() if hook is self]:
            del hooks[key]
        if self.model.__dict__.get(_STATE_ATTR) is self:
            del self.model.__dict__[_STATE_ATTR]

    def __repr__(self) -> str:
        state = "removed" if self.removed else "enabled" if self.handle else "armed"
        return f"DeferredSwap({state}, layers={len(self.layers)})"


def _arm(model: nn.Module, knobs: SwapLayerInputConverter.Config) -> None:
    state = DeferredSwap(model, knobs.swap_config(), knobs.filter_fqns)
    object.__setattr__(model, _STATE_ATTR, state)
    model.register_forward_pre_hook(state)


def deferred_swap(model: nn.Module) -> DeferredSwap:
    """The swap armed on ``model`` (built from a configuration converted by
    :class:`SwapLayerInputConverter`): its handle, blocks and managers, and ``remove()``.

    Raises:
        ValueError: ``model`` was not built from a converted configuration, or its swap was
            removed.
    """
    state = model.__dict__.get(_STATE_ATTR)
    if not isinstance(state, DeferredSwap):
        raise ValueError(
            f"swap_pass.{_API}.deferred_swap: {type(model).__name__} has no swap armed: it was "
            "not built from a configuration converted by SwapLayerInputConverter, or its swap "
            "was removed (list "
            "SwapLayerInputConverter.Config() in model_registry(..., converters=[...]))."
        )
    return state
