"""Free after the next layer, restore before backward: the layer-input protocol, in one place.

Every way in that swaps layer inputs in eager autograd follows it (the eager wrappers and
``enable_swap_layer_input`` in ``swap_pass/eager/_protocol.py``, the FBOverlap wrappers in
``swap_pass/eager/wrappers.py``, and the nodes ``apply_swap_pass`` inserts in
``swap_pass/graph/passes.py``). For the input ``x_i`` of every layer but the last, one
micro-batch::

    forward:  group_i = start the D2H copy of x_i
                  (eager: after layer i ran; FBOverlap, apply_swap_pass: at layer i's entry)
              once one layer ran alongside the copy:  free_if_unheld(group_i, ...)
                  (eager: after layer i+1 ran; FBOverlap: when layer i returns;
                   apply_swap_pass: at layer i+1's entry)
                  freed  -> x_i's device storage is gone until backward
                  kept   -> another holder reads it: the caller restores it, it stays
    backward: before the first reader of x_i:  restore_for_backward(group_i, ...)
              then:                            prefetch_ahead(groups backward reads next, config)

The caller decides *where* each step runs (a gradient hook, an autograd ``Function``, a wrapper
around a fused schedule); these functions decide *what* happens there, so the ownership check,
the order of waits and the prefetch limits are the same on every path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from swap_pass.config import SwapConfig
from swap_pass.runtime.ownership import may_free
from swap_pass.runtime.swap_tensors import DEVICE, H2D, HOST, SwapTensors

__all__ = ["free_if_unheld", "prefetch_ahead", "restore_for_backward"]


def free_if_unheld(group: SwapTensors, name: str, roots: Sequence[torch.Tensor], *,
                   accounted: Sequence[torch.Tensor] = ()) -> bool:
    """Free ``group``'s device storage once its copy ran, if nothing but autograd holds it.

    Args:
        group: A group in state "d2h" (its copy started one layer ago).
        name: The layer named in the ownership warning.
        roots: Where the graph that saved the group's tensors is reached (see
            :func:`swap_pass.runtime.ownership.may_free`).
        accounted: Holders the caller knows of and accounts for. Default: ``()``.

    Returns:
        True when the storage was freed (state "host"); False when another holder is left and
        the caller must keep the group on the device (it is still in state "d2h").
    """
    group.wait_copy_out()  # its source is no holder once the copy ran
    if may_free(group.tensors, name, roots=roots, since=group.entry_mark, accounted=accounted):
        group.wait_d2h()
        return True
    return False


def restore_for_backward(group: SwapTensors, fifo: list[SwapTensors] | None = None,
                         reader: str | None = None) -> None:
    """Make ``group`` readable on the device, from any state, before its first reader.

    Args:
        group: The layer input group.
        fifo: The manager's ``batch_stack`` the group is dropped from, if any. Default: ``None``.
        reader: Named in the error if the group is still not readable (then
            :meth:`SwapTensors.assert_on_device` is checked). Default: ``None`` (no check).
    """
    if group.stat is not DEVICE:
        group.restore()
    if fifo is not None and group in fifo:  # groups compare by identity
        fifo.remove(group)
    if reader is not None:
        group.assert_on_device(reader)


def prefetch_ahead(groups: Iterable[SwapTensors | None], config: SwapConfig) -> None:
    """Start the host-to-device copies of ``groups`` (the inputs backward reads next, nearest
    first, stopping at the first None): ``SwapConfig.prefetch_layers`` of them, while at most
    ``SwapConfig.max_copies_in_flight`` of those copies run at once."""
    limit, in_flight, ahead = config.max_copies_in_flight, 0, iter(groups)
    for _ in range(config.prefetch_layers):
        group = next(ahead, None)
        if group is None:
            return
        if group.stat is HOST:
            if limit is not None and in_flight >= limit:
                return
            group.swap_to_device()
        in_flight += group.stat is H2D
