"""``enable_swap_layer_input(model)``: the SwapLayerInput protocol without editing model code.

It finds the repeated Transformer blocks (an ``nn.ModuleList`` or ``nn.ModuleDict`` of same-class
modules: HF ``model.layers``, GPT-2 ``transformer.h``, torchtitan's ``layers`` (a ``ModuleDict``),
``nn.TransformerEncoder.layers``),
gives each block a manager in a :class:`LayerChain` that the returned handle owns (one chain per
model, under a tag of its own) and shadows the block's ``forward`` with an instance attribute.
``handle.remove()`` deletes exactly what was added.

Note: [Copies of an enabled model]
    ``copy.deepcopy`` (EMA, reference models, ``AveragedModel``) and ``pickle`` /
    ``torch.save(model)`` copy the shadowing ``forward`` (a :class:`_SwappedForward` bound to its
    block, not a closure over the original block), the handle, its chain and the managers. The
    chain copies itself as an empty chain under a new tag, and each manager as a fresh manager
    with no group in flight that joins the copied chain (one per copy: the copy's memo); so the
    copy swaps its own blocks, independently of the original, and its own ``handle.remove()``
    restores it. Copying while a forward's groups are
    still off the device (before its backward) is refused: the groups' data is not part of it.

Note: [Enabling is all or nothing]
    Every check that can refuse a model runs before anything changes. What can still fail
    after that (a block whose ``forward`` is a read-only property, a module without an instance
    ``__dict__``, an interrupt) fails while the blocks are patched one by one: the handle
    records each change before it is made and reverts them all (the blocks' ``forward``, their
    ``swap_manager``, the managers in its chain, the model's handle) before the error
    propagates, so the model and ``SwapLayerInputManager.manager_map`` are as before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from swap_pass.config import SwapConfig, check_config
from swap_pass.eager import _protocol
from swap_pass.handles import SwapHandle
from swap_pass.opt_out import ModuleFilter, check_module_filter, filtered_blocks
from swap_pass.runtime.chain import LayerChain, SwapLayerInputManager

__all__ = ["SwapLayerInputHandle", "enable_swap_layer_input", "find_layer_blocks", "give_back",
           "kept_blocks", "take_over"]


# --- Offloading checkpoints swap_pass takes over: HF transformers' and torch's OffloadWrapper ---
# Note: [Taking over HF's offload]
#     With ``offload=True`` HF gives every checkpointing module a ``_gradient_checkpointing_func``
#     that runs ``torch.utils.checkpoint.checkpoint`` inside ``save_on_cpu(pin_memory=True)``: the
#     only tensor a checkpointed layer saves, its input, is copied to the host and back on the
#     compute stream, so the step waits for both copies (and on a machine without an accelerator
#     the pinned copy raises). ``enable_swap_layer_input`` swaps the same input on side streams,
#     prefetched one layer ahead; so for each block it enables it puts HF's plain checkpoint
#     (same keyword arguments) in place of the offloading one, and ``handle.remove()`` gives the
#     block HF's function back. Blocks swap_pass leaves alone (``module_filter_fn``) keep HF's
#     offload; so does the last block's checkpoint input, which swap_pass keeps on the device (its
#     backward runs first). Gradients are bitwise the same: both move the same bytes and back.
#
#     torch's ``offload_wrapper(checkpoint_wrapper(layer))`` (accelerate's FSDP2
#     ``activation_checkpointing_offload``) does the same with a module: its ``forward`` runs the
#     checkpointed layer inside ``save_on_cpu(pin_memory=True)``. An enabled block that is such an
#     ``OffloadWrapper`` gets an instance ``forward`` that calls the checkpointed module directly,
#     and the swap goes on that module, not on the wrapper: accelerate puts ``fully_shard`` on
#     the module inside, whose pre-forward hook hands the layer an alias of its input, and only
#     the tensor the checkpoint saves may leave the device (Note: [Ownership rule] in
#     ``swap_pass/runtime/freeing.py``). ``handle.remove()`` deletes both, and the wrapper's own
#     ``forward`` offloads again. The module tree, and so every parameter's name, is unchanged.


_ATTR = "_gradient_checkpointing_func"
_SAVED = "_swap_pass_hf_checkpoint_func"


def _offloading(fn: object) -> functools.partial | None:
    """``fn`` when it is HF's offloading checkpoint (a ``partial`` of a function that enters
    ``save_on_cpu``), else None."""
    if not isinstance(fn, functools.partial):
        return None
    code = getattr(fn.func, "__code__", None)
    return fn if code is not None and "save_on_cpu" in code.co_names else None


class _WithoutSaveOnCpu:
    """An ``OffloadWrapper``'s instance ``forward`` while swap_pass serves it: the checkpointed
    layer, called without ``save_on_cpu`` (Note: [Taking over HF's offload])."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper._checkpoint_wrapped_module(*args, **kwargs)


def _is_offload_wrapper(block: nn.Module) -> bool:
    wrapper_cls = _torch_offload_wrapper()
    return wrapper_cls is not None and isinstance(block, wrapper_cls)


def _torch_offload_wrapper() -> type | None:
    """torch's ``OffloadWrapper``, or None where torch.distributed is not built."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper
    except ImportError:
        return None
    return OffloadWrapper


def take_over(block: nn.Module) -> bool:
    """Give ``block`` a checkpoint without ``save_on_cpu`` in place of HF's offloading one or
    torch's ``OffloadWrapper`` (Note: [Taking over HF's offload]); whether it had one."""
    fn = _offloading(block.__dict__.get(_ATTR))
    if fn is not None:
        object.__setattr__(block, _SAVED, fn)
        object.__setattr__(block, _ATTR, functools.partial(checkpoint, *fn.args, **fn.keywords))
        return True
    if _is_offload_wrapper(block) and "forward" not in block.__dict__:
        object.__setattr__(block, "forward", _WithoutSaveOnCpu(block))
        return True
    return False


def give_back(block: nn.Module) -> None:
    """Undo :func:`take_over` (nothing when it did not take over)."""
    fn = block.__dict__.pop(_SAVED, None)
    if fn is not None:
        object.__setattr__(block, _ATTR, fn)
    if isinstance(block.__dict__.get("forward"), _WithoutSaveOnCpu):
        del block.__dict__["forward"]


# --------------------------------------------------------------------------------------------------


_API = "enable_swap_layer_input"
_HANDLE_ATTR = "_swap_pass_handle"


class _SwappedForward:
    """A block's instance-level ``forward``: its own forward under the SwapLayerInput protocol.

    Args:
        layer: The block.
        inner: The instance-level ``forward`` the block had before, or None (its class's).
    """

    def __init__(self, layer: nn.Module, inner: Any | None) -> None:
        self.layer = layer
        self.inner = inner

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(layer.forward) sees the real signature
        if self.inner is not None:
            return self.inner
        return type(self.layer).forward.__get__(self.layer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer, inner = self.layer, self.inner  # __wrapped__, without a property call per layer
        call = inner if inner is not None else type(layer).forward.__get__(layer)
        return _protocol.run_layer(layer, call, args, kwargs, _API)


def find_layer_blocks(model: nn.Module) -> nn.ModuleList | nn.ModuleDict | list[nn.Module]:
    """The layers of ``model``: the outermost family of two or more same-class blocks under one
    parent (Note: [The layer family rule] in ``swap_pass/layer_family.py``, the rule the graph
    passes use too). MoE experts or the Linear modules of an ``nn.Sequential`` MLP are not layers.

    Returns:
        The ``nn.ModuleList`` or ``nn.ModuleDict`` that holds exactly the family (a
        ``ModuleDict``'s blocks run in insertion order, as torchtitan's do), else the blocks in
        the order they are registered (named attributes, or a container holding other modules).

    Raises:
        ValueError: No such family exists.
    """
    from swap_pass.layer_family import choose_layer_family

    named = dict(model.named_modules(remove_duplicate=False))
    names = choose_layer_family({fqn: type(m).__name__ for fqn, m in named.items()})
    if not names:
        raise ValueError(
            f"swap_pass.{_API}: found no nn.ModuleList or nn.ModuleDict of two or more "
            f"same-class blocks in "
            f"{type(model).__name__}. Pass the Transformer blocks explicitly with layers=[...]."
        )
    blocks = [named[n] for n in names]
    parent = named[names[0].rpartition(".")[0]]
    if isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and len(parent) == len(blocks):
        return parent
    return blocks


class SwapLayerInputHandle(SwapHandle):
    """What :func:`enable_swap_layer_input` changed; ``remove()`` undoes it exactly (see
    :class:`swap_pass.handles.SwapHandle`).

    Attributes:
        model: The model swap was enabled on.
        layers: The patched blocks, in call order (inside torch's ``OffloadWrapper``, the
            checkpointed module it wraps: Note: [Taking over HF's offload]).
        chain: The :class:`LayerChain` of the blocks' managers, which this handle owns.
        managers: One :class:`SwapLayerInputManager` per block, same order.
        module_tag: The chain's tag.
    """

    def __init__(self, model: nn.Module, layers: list[nn.Module], config: SwapConfig) -> None:
        self.model = model
        self.layers: list[nn.Module] = []
        self.managers: list[SwapLayerInputManager] = []
        self._taken_over: list[nn.Module] = []  # blocks whose offloading checkpoint is replaced
        self.chain = LayerChain(f"{_API}:{type(model).__name__}@{id(model):x}")
        try:  # all or nothing: see Note: [Enabling is all or nothing]
            for layer in layers:
                self._patch(layer, SwapLayerInputManager(config=config, chain=self.chain))
            object.__setattr__(model, _HANDLE_ATTR, self)
        except BaseException:
            self._undo()
            raise

    def _patch(self, block: nn.Module, manager: SwapLayerInputManager) -> None:
        """Give ``block`` (or the checkpointed module inside torch's ``OffloadWrapper``) its
        manager and its shadowing ``forward``, each change recorded before it is made, so that
        :meth:`_undo` reverts exactly what happened (Note: [Taking over HF's offload])."""
        self.managers.append(manager)
        self._taken_over.append(block)
        took_over = take_over(block)
        layer = block._checkpoint_wrapped_module if took_over and _is_offload_wrapper(block) \
            else block
        self.layers.append(layer)
        attr = _forward_attribute(layer)
        inner = layer.__dict__.get(attr)
        object.__setattr__(layer, attr, _SwappedForward(layer, inner))
        object.__setattr__(layer, "swap_manager", manager)

    def _revert(self) -> None:
        for layer in self.layers:
            _unpatch(layer)
        for block in self._taken_over:
            give_back(block)
        for manager in self.managers:
            manager.unregister()

    def _undo(self) -> None:
        """Revert every block patched so far and drop the managers (a failed enable)."""
        self._revert()
        if self.model.__dict__.get(_HANDLE_ATTR) is self:
            del self.model.__dict__[_HANDLE_ATTR]

    @property
    def module_tag(self) -> str:
        """The tag of the handle's chain (a copy of the model has its own)."""
        return self.chain.tag

    @property
    def active(self) -> bool:
        """True until :meth:`remove` ran."""
        return self.model.__dict__.get(_HANDLE_ATTR) is self

    def _remove(self) -> None:
        """Restore every block's ``forward`` and drop the managers.

        Safe at any point, also between a forward and its backward: every input still off the
        device is restored first (that backward then runs unswapped and exact).
        """
        self._revert()
        del self.model.__dict__[_HANDLE_ATTR]

    def _repr_fields(self) -> dict[str, object]:
        return {"model": type(self.model).__name__, "layers": len(self.layers)}


# Note: [Inside accelerate's hooks]
# accelerate (HF ``device_map``, ``dispatch_model``, CPU offload) replaces a block's ``forward``
# with one that runs its hook's ``pre_forward`` (moving the inputs to the block's device, loading
# offloaded weights) and then calls ``block._old_forward``. A swap wrapper put on ``forward``
# would see the input before the move, on the previous block's device, and swap a tensor the
# block never saves. So where a block carries accelerate's hook, the wrapper shadows
# ``_old_forward``: it runs after the move, on the tensor the block saves. A hook added after
# ``enable_swap_layer_input`` takes the wrapper as its ``_old_forward`` by itself.


def _forward_attribute(layer: nn.Module) -> str:
    """The attribute the swap wrapper shadows: ``forward``, or ``_old_forward`` inside
    accelerate's hook (see Note: [Inside accelerate's hooks])."""
    if "_hf_hook" in layer.__dict__ and "_old_forward" in layer.__dict__:
        return "_old_forward"
    return "forward"


def _unpatch(layer: nn.Module) -> None:
    """Give ``layer`` back the ``forward`` (or ``_old_forward``) it had: its own instance
    attribute, or its class's."""
    for attr in ("forward", "_old_forward"):
        patched = layer.__dict__.get(attr)
        if isinstance(patched, _SwappedForward):
            del layer.__dict__[attr]
            if patched.inner is not None:
                layer.__dict__[attr] = patched.inner
            elif attr == "_old_forward":  # accelerate's hook came later: it calls this one
                layer.__dict__[attr] = type(layer).forward.__get__(layer)
    layer.__dict__.pop("swap_manager", None)


def _check_layers(model: nn.Module, layers: Iterable[nn.Module] | None) -> list[nn.Module]:
    if model.__dict__.get(_HANDLE_ATTR) is not None:
        raise RuntimeError(
            f"swap_pass.{_API}: swap is already enabled on this {type(model).__name__}. "
            "Call handle.remove() before enabling it again."
        )
    container = find_layer_blocks(model) if layers is None else layers
    found = list(container.values() if isinstance(container, nn.ModuleDict) else container)
    _refuse_repeated_instances(found)
    for idx, layer in enumerate(found):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"swap_pass.{_API}: layers[{idx}] is a {type(layer).__name__}. "
                            "Every layer must be an nn.Module.")
        if hasattr(layer, "swap_manager"):
            raise RuntimeError(
                f"swap_pass.{_API}: layers[{idx}] ({type(layer).__name__}) already has a swap "
                "manager (decorated class or another enable). A layer may be swapped by one only."
            )
    if not found:
        raise ValueError(f"swap_pass.{_API}: layers is empty. Pass at least one block.")
    refuse_module_compile(model, found, _API)
    return found


def refuse_module_compile(model: nn.Module, found: list[nn.Module], api: str) -> None:
    """Refuse blocks (or a model) compiled with ``nn.Module.compile``.

    ``module.compile()`` compiles the module's whole ``__call__``: the swap protocol around a
    block's ``forward`` would run inside the compiled region, where Dynamo cannot trace it (it
    reads the autograd engine's state and moves storages). torchtitan's ``compile.enable``
    (component ``"model"``) compiles every block this way.

    Raises:
        RuntimeError: ``model`` or one of ``found`` has a compiled ``__call__``.
    """
    compiled = [(f"layers[{idx}]", layer) for idx, layer in enumerate(found)]
    compiled = [(where, mod) for where, mod in [("the model", model), *compiled]
                if getattr(mod, "_compiled_call_impl", None) is not None]
    if compiled:
        where, mod = compiled[0]
        raise RuntimeError(
            f"swap_pass.{api}: {where} ({type(mod).__name__}) was compiled with "
            "nn.Module.compile() (torchtitan's compile.enable with the 'model' component does "
            "this to every block), which compiles its whole __call__; the swap between blocks "
            "cannot run inside a compiled region. Compile the blocks with "
            "swap_pass.compile_layers(model, backend=...) instead (it compiles each block's "
            "forward and swaps between them eagerly; turn torchtitan's model compile off), or "
            "compile the whole model with swap_pass.swap_backend."
        )


def _refuse_repeated_instances(found: list[object]) -> None:
    first: dict[int, int] = {}
    for idx, layer in enumerate(found):
        if id(layer) in first:
            raise ValueError(
                f"swap_pass.{_API}: layers[{idx}] is the same {type(layer).__name__} instance as "
                f"layers[{first[id(layer)]}] (one block shared by several positions, e.g. "
                "nn.ModuleList([block] * n)). Its input cannot be swapped per position; swap "
                "distinct blocks only (pass layers=[...] without repeats), or leave this model "
                "unswapped."
            )
        first[id(layer)] = idx


def enable_swap_layer_input(model: nn.Module, *, layers: Iterable[nn.Module] | None = None,
                            config: SwapConfig | None = None,
                            module_filter_fn: ModuleFilter = None) -> SwapLayerInputHandle:
    """Swap each Transformer block's input to host memory between forward and backward.

    Args:
        model: The model. Its source is not edited; blocks get an instance-level ``forward``.
        layers: The blocks, in the order they run (an ``nn.ModuleDict`` gives its values).
            Default: ``None``, found with :func:`find_layer_blocks`.
        config: Runtime knobs for the blocks' managers. Default: ``SwapConfig()``.
        module_filter_fn: ``(module, fqn) -> bool`` (torchao's shape), asked once per block with
            its name in ``model``; blocks it returns False for run unchanged and keep their
            input. Default: ``None`` (every block).

    A model set up with HF's ``activation_checkpointing_enable(offload=True)``, or whose blocks
    are torch's ``offload_wrapper(checkpoint_wrapper(block))`` (accelerate's FSDP2
    ``activation_checkpointing_offload``), has its synchronous ``save_on_cpu`` replaced by this
    swap on the enabled blocks, until ``remove()`` (Note: [Taking over HF's offload] in
    ``swap_pass/eager/enable.py``).

    Returns:
        A handle; ``handle.remove()`` (or leaving ``with handle:``) restores the model exactly.

    Raises:
        RuntimeError: Swap is already enabled on ``model`` or on one of the blocks, or the model
            or a block was compiled with ``nn.Module.compile()``.
        ValueError: No repeated blocks were found, ``layers`` is empty, one block instance
            appears at several positions, or ``module_filter_fn`` refuses every block.
        TypeError: ``config`` is not a :class:`SwapConfig`, or ``module_filter_fn`` is not
            callable.
    """
    config = check_config(config, _API)
    check_module_filter(module_filter_fn, _API)
    found = _check_layers(model, layers)
    return SwapLayerInputHandle(model, kept_blocks(model, found, module_filter_fn, _API), config)


def kept_blocks(model: nn.Module, found: list[nn.Module], module_filter_fn: ModuleFilter,
                api: str) -> list[nn.Module]:
    """The blocks of ``found`` that ``module_filter_fn`` keeps.

    Raises:
        ValueError: it keeps none of them.
    """
    kept = filtered_blocks(model, found, module_filter_fn)
    if not kept:
        raise ValueError(
            f"swap_pass.{api}: module_filter_fn returned False for all {len(found)} blocks "
            f"({type(found[0]).__name__}). It must keep at least one block; to swap nothing, "
            "do not enable swap (or run the step inside swap_pass.no_swap())."
        )
    return kept
