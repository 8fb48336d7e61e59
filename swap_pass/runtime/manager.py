"""Per-layer swap bookkeeping: which groups of a layer are off the device, in micro-batch order.

The steps of the protocol (what frees when, what restores when) are in
``swap_pass/runtime/protocol.py``; a manager keeps one layer's groups for them. Forward of layer
``i`` (MindSpeed's protocol, driven by the eager wrappers)::

    layer i runs -> manager[i-1].free_swapped_out()     # wait D2H of layer i-1's input, free it
                 -> manager[i].swap_out(layer i input)  # start its D2H (not for the last layer)

Backward of layer ``i``::

    before layer i's first reader -> manager[i].wait_swap_in(group)  # H2D done before any read
                                  -> manager[i-1].prefetch()         # start the next H2D early

``batch_stack`` is a FIFO with one :class:`SwapTensors` per micro-batch in flight: pipeline
schedules run the backwards of one layer in the order of its forwards, so the oldest group is the
one the next backward needs. Callers that hold their group pass it explicitly instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from types import MappingProxyType

import torch

from swap_pass.config import SwapConfig, check_config
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime.chain import (
    LayerChain,
    chain_of_tag,
    find_chain,
    layer_map,
    reset_chains,
)
from swap_pass.runtime.device import is_async_device
from swap_pass.runtime.host_pool import block_bytes, preflight
from swap_pass.runtime.ownership import swappable_layer_inputs
from swap_pass.runtime.protocol import restore_for_backward
from swap_pass.runtime.skips import SkipReason, record_skip
from swap_pass.runtime.subclasses import claim_not_plain
from swap_pass.runtime.swap_tensors import (
    D2H,
    HOST,
    SwapTensors,
    is_valid_for_swap,
    restore_or_keep,
)

__all__ = ["SwapLayerInputManager"]


def _rebuild_manager(chain: LayerChain, custom_check_fn, prefetch: bool,
                     config: SwapConfig) -> SwapLayerInputManager:
    return SwapLayerInputManager(chain.tag, custom_check_fn, prefetch, config, chain=chain)


class _ManagerMapView:
    """``SwapLayerInputManager.manager_map``: ``{module_tag: [manager, ...]}`` of every live
    chain with registered managers, in layer order; read-only (built at each read)."""

    def __get__(self, obj: object, owner: type) -> MappingProxyType:
        return MappingProxyType(layer_map())


def _opted_out(tensors: list[torch.Tensor], where: str) -> list[torch.Tensor]:
    """Count ``tensors`` as kept inside :func:`swap_pass.no_swap`; claim none of them."""
    for t in tensors:
        record_skip(SkipReason.NO_SWAP, t.numel() * t.element_size(), where=where)
    return []


class SwapLayerInputManager:
    """Swap bookkeeping of one layer instance: its place in a :class:`LayerChain`, its FIFO.

    Args:
        module_tag: Groups managers into one layer sequence (one block type): a manager built
            without ``chain`` joins the chain of its tag. Default: ``"default"``.
        custom_check_fn: Extra predicate for which tensors may be swapped. Default: ``None``.
        prefetch: Whether backward should start this layer's H2D one layer ahead. Default: ``True``.
        config: Runtime knobs shared by the layer's groups. Default: ``SwapConfig()``.
        chain: The chain to join as its last layer (a handle's: one model). Default: ``None``
            (the chain of ``module_tag``).

    Attributes:
        manager_map: Class-level, read-only ``{module_tag: [manager, ...]}`` of every chain, in
            layer order (a view: see ``swap_pass/runtime/chain.py``).
        chain: The chain this manager belongs to.
        module_tag: Its chain's tag.
        layer_idx: This manager's position in its chain.
        previous: The manager of the layer before this one, if any (None once unregistered).
        next: The manager of the layer after this one, if any (None once unregistered).
        is_last_layer: True for the last layer of the chain, whose input is never swapped.
        name: The layer's name in warnings and errors: ``"<module_tag>.layers[<layer_idx>]"``.
        batch_stack: FIFO of this layer's groups in flight, one per micro-batch.
        layer_parameter: A weak reference to the layer's first parameter, kept by the eager
            wrappers for their device check (see ``check_device`` in
            ``swap_pass/eager/_layer_io.py``); None until the first call.
    """

    manager_map = _ManagerMapView()

    def __init__(
        self,
        module_tag: str = "default",
        custom_check_fn: Callable[[torch.Tensor], bool] | None = None,
        prefetch: bool = True,
        config: SwapConfig | None = None,
        *,
        chain: LayerChain | None = None,
    ) -> None:
        self.chain = chain_of_tag(module_tag) if chain is None else chain
        self.module_tag = self.chain.tag
        self.custom_check_fn = custom_check_fn
        self.config = (SwapConfig(prefetch=prefetch) if config is None
                       else check_config(config, "SwapLayerInputManager"))
        self.prefetch_enabled = prefetch and self.config.prefetch
        self.batch_stack: list[SwapTensors] = []
        self.layer_parameter: weakref.ref[torch.nn.Parameter] | None = None
        self._preflighted: set[int] = set()
        self.chain.add(self)

    def __repr__(self) -> str:
        return (f"SwapLayerInputManager(module_tag={self.module_tag!r}, "
                f"layer_idx={self.layer_idx}, "
                f"num_layers={self.num_layers}, in_flight={len(self.batch_stack)})")

    def __reduce__(self) -> tuple:
        """Copy (deepcopy, pickle) as a fresh manager with nothing in flight, under a new tag."""
        if self.batch_stack:
            raise RuntimeError(
                f"swap_pass.SwapLayerInputManager: cannot copy or pickle {self.name}: "
                f"{len(self.batch_stack)} swapped input(s) of a forward are still in flight. "
                "Copy the model after backward (or after swap_pass.reset())."
            )
        return (_rebuild_manager, (self.chain, self.custom_check_fn, self.prefetch_enabled,
                                   self.config))

    # --- position in the layer sequence -------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Number of managers in this manager's chain."""
        return len(self.chain.layers)

    def _set_place(self, idx: int, previous: SwapLayerInputManager | None,
                   next: SwapLayerInputManager | None, *, registered: bool = True) -> None:
        self.layer_idx = idx
        self.previous = previous
        self.next = next
        self.is_last_layer = registered and next is None
        self.name = f"{self.module_tag}.layers[{idx}]"
        self._in_map = registered

    def _drop_place(self) -> None:
        """Out of its chain: no neighbours until registered again (index kept)."""
        self._set_place(self.layer_idx, None, None, registered=False)

    def ensure_registered(self) -> None:
        """Called at each layer call: after :func:`swap_pass.reset`, join the chain again.

        The managers of the chain that reset() retired come back together, in their old order,
        so that the first step after a reset swaps exactly like the steps before it (Note:
        [Reset retires a chain's managers] in ``swap_pass/runtime/chain.py``).
        """
        if self._in_map:  # every call but the first after a reset
            return
        self.chain.rejoin(self)

    def unregister(self) -> None:
        """Leave the chain (restoring this manager's groups); the rest is renumbered."""
        self.clear()
        self.chain.remove(self)

    # --- forward side -------------------------------------------------------------------------

    def claim(self, tensors: list[torch.Tensor], *,
              leaves_owned: bool = False) -> list[torch.Tensor]:
        """The layer inputs that may leave the device, decided at the layer's entry.

        See Note: [Ownership rule] in ``swap_pass/runtime/ownership.py``: user data and storages
        another live tensor shares stay (counted in :func:`swap_pass.swap_stats`).
        ``leaves_owned``: see :func:`swap_pass.runtime.ownership.swappable_layer_inputs`.
        A ``DTensor`` or ``AsyncCollectiveTensor`` input gives its local tensor in its place;
        any other tensor that may not leave is counted by reason (see Note: [Swapping through
        the local tensor] in ``swap_pass/runtime/subclasses.py``). Inside
        :func:`swap_pass.no_swap` nothing is claimed (counted under ``SkipReason.NO_SWAP``).
        """
        if not swap_allowed():
            return _opted_out(tensors, self.name)
        valid = []  # a loop, not a comprehension: most calls pass one tensor
        for t in tensors:
            if is_valid_for_swap(t, self.custom_check_fn):
                valid.append(t)
            else:  # the rare path: a wrapper subclass, or a tensor to count as skipped
                return self._claim_mixed(list(tensors), leaves_owned)
        return swappable_layer_inputs(valid, self.name, leaves_owned=leaves_owned)

    def _claim_mixed(self, tensors: list[torch.Tensor], leaves_owned: bool) -> list[torch.Tensor]:
        """:meth:`claim` for inputs of which some are not plain swappable tensors."""
        valid, local = [], []
        for t in tensors:
            if is_valid_for_swap(t, self.custom_check_fn):
                valid.append(t)
                continue
            kept = claim_not_plain(t, self.name, self.custom_check_fn, leaves_owned=leaves_owned)
            if kept is not None:
                local.append(kept)
        return swappable_layer_inputs(valid, self.name, leaves_owned=leaves_owned) + local

    def swap_out(self, tensors: Iterable[torch.Tensor], name: str | None = None, *,
                 copy_span: bool = False,
                 compute_stream: torch.Stream | None = None) -> SwapTensors:
        """Queue a group for ``tensors`` (one micro-batch) and start its device-to-host copy.

        The first layer's first group of each size runs :meth:`preflight_for` first.
        ``copy_span`` is for the list that :meth:`claim` returned (see :class:`SwapTensors`):
        its tensors are not checked again, and the group keeps the list. ``compute_stream``:
        the stream current at the layer's entry (default: the current one).
        """
        group = SwapTensors(tensors, custom_check_fn=self.custom_check_fn, config=self.config,
                            name=name or self.name, copy_span=copy_span, checked=copy_span,
                            compute_stream=compute_stream)
        if self.layer_idx == 0:  # in the bytes the host allocator sets aside (pinned: rounded)
            pinned = (self.config.pin_memory and group.device is not None
                      and is_async_device(group.device))
            self.preflight_for(block_bytes(group.host_nbytes, pinned))
        self.batch_stack.append(group)
        group.swap_to_host()
        self.chain.note_copy(self, group)
        return group

    def copying_earlier(self) -> list[tuple[SwapLayerInputManager, SwapTensors]]:
        """``(manager, group)`` for earlier layers' groups whose device-to-host copy runs.

        Nearest layer first, each layer's groups in micro-batch order; empty when this manager
        is not registered.
        """
        if not self.chain.copying or not self._in_map:
            return []
        found = self.chain.copying_before(self.layer_idx)
        if len(found) > 1:  # nearest layer first; sort is stable: micro-batch order kept
            found.sort(key=lambda entry: -entry[0].layer_idx)
        return found

    def preflight_for(self, group_nbytes: int) -> None:
        """Before the first step of a shape: check the host can hold every layer's group at once.

        Every layer but the last holds a group of about ``group_nbytes`` on the host at the end
        of forward, so ``group_nbytes * (num_layers - 1)`` must fit in available host memory.
        Checked once per size; only under ``on_host_exhausted="error"`` (the cap itself is
        enforced by the pool when buffers are taken).

        Raises:
            HostMemoryError: naming the bytes needed and the bytes available.
        """
        if group_nbytes in self._preflighted or self.config.on_host_exhausted != "error":
            return
        preflight(group_nbytes * max(self.num_layers - 1, 1))
        self._preflighted.add(group_nbytes)

    def free_swapped_out(self) -> None:
        """Wait for every started device-to-host copy of this layer and free its device storage."""
        for group in self.batch_stack:
            if group.stat == D2H:
                group.wait_d2h()

    # --- backward side ------------------------------------------------------------------------

    def prefetch(self, group: SwapTensors | None = None) -> SwapTensors | None:
        """Start the host-to-device copy of ``group`` (default: the oldest group on the host)."""
        if group is None:
            group = next((g for g in self.batch_stack if g.stat == HOST), None)
        if group is not None and group.stat == HOST:
            group.swap_to_device()
        return group

    def wait_swap_in(self, group: SwapTensors | None = None) -> SwapTensors | None:
        """Make ``group`` (default: the oldest) readable on the device and drop it from the FIFO.

        Whatever state the group is in, this returns with its data on the device and the compute
        stream ordered after the copy: call it before the first reader of the layer's input.
        """
        if group is None:
            if not self.batch_stack:
                return None
            group = self.batch_stack[0]
        restore_for_backward(group, self.batch_stack)
        return group

    # --- cleanup ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Bring every group in flight back to the device and forget it (buffers to the pool).

        Its tensors may still be read (a backward that runs later, the caller's own reference):
        their data is restored, never dropped.
        """
        while self.batch_stack:  # a group that cannot be restored now is kept, never dropped
            restore_or_keep(self.batch_stack.pop(0))

    def discard(self, group: SwapTensors) -> None:
        """Discard one group whose tensors will never be read again (its graph was freed)."""
        group.discard()
        self.wait_swap_in(group)  # the group is in state "device" now: this only forgets it

    # --- class-level helpers ------------------------------------------------------------------

    @classmethod
    def managers(cls, module_tag: str = "default") -> list[SwapLayerInputManager]:
        """The managers registered in the chain named ``module_tag``, in layer order (a copy)."""
        chain = find_chain(module_tag)
        return chain.managers() if chain is not None else []

    @classmethod
    def reset_all(cls) -> None:
        """Restore every group of every chain and empty ``manager_map``.

        A manager whose layer is still alive joins its chain again at its next call
        (:meth:`ensure_registered`), with its peers in their old order.
        """
        reset_chains()
