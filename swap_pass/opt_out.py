"""Opt-outs shared by every way in: ``no_swap()`` and ``module_filter_fn(module, fqn)``.

Note: [Opting out]
    ``with swap_pass.no_swap():`` swaps nothing that is offered inside it, on this thread: the
    eager layer protocol (decorators, ``enable_swap_layer_input``, ``compile_layers``) keeps each
    layer input on the device, a compiled graph's ``swap_out`` keeps its tensor, SmartSwap's pack
    hook leaves saved tensors to autograd, and a selective-checkpoint offload tag saves the
    tensor on the device. Each of them is counted under ``SkipReason.NO_SWAP`` (no warning: the
    user asked for it). What was swapped before the block is restored as usual.

    ``module_filter_fn(module, fqn) -> bool`` is torchao's shape: ``False`` leaves ``module`` (and
    everything that runs inside it) out. Layer-based ways in apply it to each layer block; SmartSwap
    to the modules that run when a tensor is saved, the block and each of its parents.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from swap_pass.state import no_swap_depth as _depth

__all__ = ["ModuleFilter", "check_module_filter", "filtered_blocks", "no_swap", "swap_allowed"]

ModuleFilter = Callable[[nn.Module, str], bool] | None


@contextlib.contextmanager
def no_swap() -> Iterator[None]:
    """Swap nothing offered inside this block, on this thread (see Note: [Opting out]).

    Blocks nest; tensors swapped before the block come back as usual.

    Example::

        with swap_pass.no_swap():
            loss = model(batch)        # every layer input stays on the device
        loss.backward()
    """
    _depth.depth = getattr(_depth, "depth", 0) + 1
    try:
        yield
    finally:
        _depth.depth -= 1


def swap_allowed() -> bool:
    """False inside :func:`no_swap` on this thread."""
    return not getattr(_depth, "depth", 0)


def check_module_filter(module_filter_fn: object, api: str) -> None:
    """Raise unless ``module_filter_fn`` is None or callable.

    Raises:
        TypeError: naming ``api`` and the value.
    """
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            f"swap_pass.{api}: module_filter_fn={module_filter_fn!r:.80} is a "
            f"{type(module_filter_fn).__name__}. It must be a callable (module, fqn) -> bool, "
            "or None."
        )


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): fqn for fqn, m in model.named_modules(remove_duplicate=False)}


def filtered_blocks(model: nn.Module, blocks: list[nn.Module],
                    module_filter_fn: ModuleFilter) -> list[nn.Module]:
    """The blocks ``module_filter_fn(block, fqn)`` keeps, in order (all of them when it is None).

    ``fqn`` is the block's name in ``model`` (``""`` for a block ``model`` does not hold).
    """
    if module_filter_fn is None:
        return blocks
    names = _names(model)
    return [b for b in blocks if module_filter_fn(b, names.get(id(b), ""))]
