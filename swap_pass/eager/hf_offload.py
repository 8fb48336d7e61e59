"""HF transformers' ``activation_checkpointing_enable(offload=True)``, taken over by swap_pass.

Note: [Taking over HF's offload]
    With ``offload=True`` HF gives every checkpointing module a ``_gradient_checkpointing_func``
    that runs ``torch.utils.checkpoint.checkpoint`` inside ``save_on_cpu(pin_memory=True)``: the
    only tensor a checkpointed layer saves, its input, is copied to the host and back on the
    compute stream, so the step waits for both copies (and on a machine without an accelerator
    the pinned copy raises). ``enable_swap_layer_input`` swaps the same input on side streams,
    prefetched one layer ahead; so for each block it enables it puts HF's plain checkpoint
    (same keyword arguments) in place of the offloading one, and ``handle.remove()`` gives the
    block HF's function back. Blocks swap_pass leaves alone (``module_filter_fn``) keep HF's
    offload; so does the last block's checkpoint input, which swap_pass keeps on the device (its
    backward runs first). Gradients are bitwise the same: both move the same bytes and back.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["give_back", "take_over"]

_ATTR = "_gradient_checkpointing_func"
_SAVED = "_swap_pass_hf_checkpoint_func"


def _offloading(fn: object) -> functools.partial | None:
    """``fn`` when it is HF's offloading checkpoint (a ``partial`` of a function that enters
    ``save_on_cpu``), else None."""
    if not isinstance(fn, functools.partial):
        return None
    code = getattr(fn.func, "__code__", None)
    return fn if code is not None and "save_on_cpu" in code.co_names else None


def take_over(block: nn.Module) -> bool:
    """Give ``block`` HF's plain checkpoint in place of its offloading one (Note: [Taking over
    HF's offload]); whether it had one."""
    fn = _offloading(block.__dict__.get(_ATTR))
    if fn is None:
        return False
    object.__setattr__(block, _SAVED, fn)
    object.__setattr__(block, _ATTR, functools.partial(checkpoint, *fn.args, **fn.keywords))
    return True


def give_back(block: nn.Module) -> None:
    """Undo :func:`take_over` (nothing when it did not take over)."""
    fn = block.__dict__.pop(_SAVED, None)
    if fn is not None:
        object.__setattr__(block, _ATTR, fn)
