"""The layer-input protocol: its steps, one layer's queue of groups, and the chain of layers.

Free after the next layer, restore before backward. Every way in that swaps layer inputs in eager
autograd follows it (the eager wrappers and ``enable_swap_layer_input`` in
``swap_pass/eager/_protocol.py``, the FBOverlap wrappers in ``swap_pass/eager/wrappers.py``, and
the nodes ``apply_swap_pass`` inserts in ``swap_pass/graph/passes.py``). For the input ``x_i`` of
every layer but the last, one micro-batch::

    forward:  group_i = manager_i.swap_out(x_i): start its D2H copy, at layer i's entry
              once one layer ran alongside the copy:  free_if_unheld(group_i, ...)
                  (eager, apply_swap_pass: after layer i+1; FBOverlap: when layer i returns)
                  freed  -> x_i's device storage is gone until backward
                  kept   -> another holder reads it: manager_i.keep_on_device(group_i)
    backward: before the first reader of x_i:  restore_for_backward(group_i, ...)
              then:                            prefetch_ahead(groups backward reads next, config)

The caller decides *where* each step runs (a gradient hook, an autograd ``Function``, a wrapper
around a fused schedule); the functions here decide *what* happens there, so the ownership check,
the order of waits and the prefetch limits are the same on every path.

Who owns what::

    SwapLayerInputHandle (enable_swap_layer_input)  ->  LayerChain  ->  SwapLayerInputManager, ...
    decorated layers, one module_tag                ->  LayerChain  (kept by tag, see below)
    SwapLayerInputManager                           ->  its FIFO of SwapTensors groups in flight

A chain numbers its managers (each manager's ``layer_idx``, ``previous``, ``next``,
``is_last_layer``), lists the device-to-host copies its managers started that may still run
(``copying``), and carries the per-step flags of the eager driver. A handle owns the chain of its
model: the chain lives as long as the handle or the model's managers. Managers built without a
chain (MindSpeed's decorators, direct construction) join the chain of their ``module_tag``, kept
in ``state.chains_by_tag`` until :func:`swap_pass.reset`. ``SwapLayerInputManager.manager_map``
is a read-only view of every live chain.

Note: [Reset retires a chain's managers]
    :func:`swap_pass.reset` restores every group in flight and empties every chain: its managers
    are kept only weakly (``_retired``) and leave ``manager_map``. A manager whose layer is still
    alive joins its chain again at its next call (:meth:`LayerChain.rejoin`), together with its
    peers, in their old order, so the first step after a reset swaps exactly like the steps
    before it, and managers of layers that died meanwhile are gone. Chains kept by tag are
    dropped at a reset: their managers keep them.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import MappingProxyType

import torch

from swap_pass.config import SwapConfig, check_config
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime.device import is_async_device
from swap_pass.runtime.freeing import claim_not_plain, may_free, swappable_layer_inputs
from swap_pass.runtime.group import (
    D2H,
    DEVICE,
    H2D,
    HOST,
    SwapTensors,
    is_valid_for_swap,
    restore_or_keep,
)
from swap_pass.runtime.host_pool import block_bytes, preflight
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.state import chains as _chains
from swap_pass.state import chains_by_tag as _by_tag
from swap_pass.state import chains_lock as _lock

__all__ = ["LayerChain", "SwapLayerInputManager", "chain_of_tag", "find_chain",
           "free_if_unheld", "layer_map", "prefetch_ahead", "reset_chains", "restore_for_backward",
           "still_copying"]


# --- the protocol's steps -------------------------------------------------------------------------


def free_if_unheld(group: SwapTensors, name: str, roots: Sequence[torch.Tensor], *,
                   accounted: Sequence[torch.Tensor] = ()) -> bool:
    """Free ``group``'s device storage once its copy ran, if nothing but autograd holds it.

    Args:
        group: A group in state "d2h" (its copy started one layer ago).
        name: The layer named in the ownership warning.
        roots: Where the graph that saved the group's tensors is reached (see
            :func:`swap_pass.runtime.freeing.may_free`).
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


# --- one layer's queue ----------------------------------------------------------------------------
# A manager keeps one layer's groups for the steps above: ``batch_stack`` is a FIFO with one
# :class:`SwapTensors` per micro-batch in flight. Pipeline schedules run the backwards of one layer
# in the order of its forwards, so the oldest group is the one the next backward needs; callers
# that hold their group pass it explicitly instead. :meth:`SwapLayerInputManager.keep_on_device`
# gives up on a group (it stays, or comes back, on the device and leaves the FIFO);
# :meth:`SwapLayerInputManager.wait_swap_in` is the backward's wait, MindSpeed's name.


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
            ``swap_pass/eager/_protocol.py``); None until the first call.
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

        See Note: [Ownership rule] in ``swap_pass/runtime/freeing.py``: user data and storages
        another live tensor shares stay (counted in :func:`swap_pass.swap_stats`).
        ``leaves_owned``: see :func:`swap_pass.runtime.freeing.swappable_layer_inputs`.
        A ``DTensor`` or ``AsyncCollectiveTensor`` input gives its local tensor in its place;
        any other tensor that may not leave is counted by reason (see Note: [Swapping through
        the local tensor] in ``swap_pass/runtime/freeing.py``). Inside
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

    # --- backward side ------------------------------------------------------------------------

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

    def keep_on_device(self, group: SwapTensors) -> None:
        """Give up on swapping ``group``: its data stays on (or comes back to) the device and it
        leaves the FIFO (a group no guard can protect, or one another holder reads)."""
        restore_for_backward(group, self.batch_stack)

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
        self.keep_on_device(group)  # the group is in state "device" now: this only forgets it

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


# --- the chain ------------------------------------------------------------------------------------


# Chain membership (state.chains, state.chains_by_tag) takes state.chains_lock: registration is
# rare (construction, enable, remove, the first call after a reset); the swap path takes no lock.
_copy_numbers = itertools.count(1)

# A chain's list of copies that may still run is compacted by every copying_earlier() call; one
# that no caller scans is compacted when it grows past this many entries.
COMPACT_COPYING_AT = 64


class LayerChain:
    """The ordered per-layer managers of one model (or of one ``module_tag``).

    Args:
        tag: Names the chain in ``manager_map``, warnings and errors.
        by_tag: Whether this module keeps the chain (managers built without an owner): it is
            then found again by :func:`chain_of_tag`. Default: ``False`` (a handle owns it).

    Attributes:
        tag: The chain's name (a copy of a model gets a new one).
        layers: Its registered managers, in layer order (do not modify; see :meth:`add`).
        copying: ``(manager, weak reference to group)`` for the groups whose device-to-host
            copy a manager started and that may still be in "d2h", in start order: finding
            earlier layers' copies at every layer call walks these, not every earlier FIFO.
            Weak: a group whose copy is over must not stay alive until the next scan.
        maybe_unguarded: A no-grad layer call left a group that no guard protects yet (Note:
            [No-grad first forward] in ``swap_pass/eager/_protocol.py``).
        missed: Layer inputs kept on the device this step that backward needs (Note: [Never a
            silent step] in ``swap_pass/eager/_protocol.py``).
    """

    def __init__(self, tag: str, *, by_tag: bool = False) -> None:
        self.tag = tag
        self.by_tag = by_tag
        self.layers: list[SwapLayerInputManager] = []
        self.copying: list[tuple[SwapLayerInputManager, weakref.ref[SwapTensors]]] = []
        self._copy_lock = threading.Lock()
        self.maybe_unguarded = False
        self.missed = 0
        self._retired: list[weakref.ref[SwapLayerInputManager]] = []
        with _lock:
            _chains[tag] = self

    def __repr__(self) -> str:
        return f"LayerChain(tag={self.tag!r}, layers={len(self.layers)})"

    def __reduce__(self) -> tuple:
        """Copy (deepcopy, pickle) as an empty chain under a new tag; the managers copied with
        it join it (Note: [Copies of an enabled model] in ``swap_pass/eager/enable.py``).
        ``deepcopy`` and ``pickle`` copy a shared object once per copy (their memo), so every
        manager of one copied model lands in the same new chain."""
        return (_copied_chain, (self.tag.split("+copy")[0], self.by_tag))

    # --- membership ---------------------------------------------------------------------------

    def add(self, manager: SwapLayerInputManager) -> None:
        """Append ``manager`` as the chain's last layer."""
        with _lock:
            self.layers.append(manager)
            self._hold()
            self._renumber()

    def remove(self, manager: SwapLayerInputManager) -> None:
        """Drop ``manager`` (its groups already restored) and renumber the rest."""
        with _lock:
            if manager in self.layers:
                self.layers.remove(manager)
            self._retired = [ref for ref in self._retired if ref() not in (None, manager)]
            with self._copy_lock:
                self.copying[:] = [entry for entry in self.copying if entry[0] is not manager]
            manager._drop_place()
            self._renumber()
            if not self.layers and not self._retired and _by_tag.get(self.tag) is self:
                del _by_tag[self.tag]

    def rejoin(self, manager: SwapLayerInputManager) -> None:
        """After a reset: register ``manager`` again, with its retired peers in their old order
        (Note: [Reset retires a chain's managers])."""
        with _lock:
            if manager._in_map:
                return
            peers = [m for m in (ref() for ref in self._retired) if m is not None]
            self._retired = []
            for m in peers if manager in peers else [*peers, manager]:
                if m not in self.layers:
                    self.layers.append(m)
            self._hold()
            self._renumber()

    def managers(self) -> list[SwapLayerInputManager]:
        """The registered managers, in layer order (a copy)."""
        with _lock:
            return list(self.layers)

    def _hold(self) -> None:
        if self.by_tag:
            _by_tag[self.tag] = self
        if _chains.get(self.tag) is not self:
            _chains[self.tag] = self

    def _renumber(self) -> None:
        """Give each manager its place (call with ``_lock`` held).

        Places are plain attributes, set here at every change of the chain rather than looked
        up at each of the several reads per layer call.
        """
        layers, last = self.layers, len(self.layers) - 1
        for idx, manager in enumerate(layers):
            manager._set_place(idx, layers[idx - 1] if idx > 0 else None,
                               layers[idx + 1] if idx < last else None)

    # --- copies in flight ---------------------------------------------------------------------

    # Note: [Copies in flight across threads]
    # Autograd runs a backward thread per device, so the guards of a model split across devices
    # (HF device_map, accelerate's dispatch) note and scan one chain's ``copying`` at once, and
    # a scan compacts the list in place: unguarded, an append racing a compaction is lost or
    # lands in a slot being cut. ``_copy_lock`` orders them; it is held for a list's length of
    # weakref reads, never across a copy or a wait.

    def note_copy(self, manager: SwapLayerInputManager, group: SwapTensors) -> None:
        """``manager`` started ``group``'s device-to-host copy."""
        with self._copy_lock:  # Note: [Copies in flight across threads]
            copying = self.copying
            copying.append((manager, weakref.ref(group)))
            if len(copying) > COMPACT_COPYING_AT:  # callers that never scan (FBOverlap)
                still_copying(copying, 0)

    def copying_before(self, before: int) -> list[tuple[SwapLayerInputManager, SwapTensors]]:
        """:func:`still_copying` on this chain's copies, under its lock."""
        with self._copy_lock:  # Note: [Copies in flight across threads]
            return still_copying(self.copying, before)

    # --- reset --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Restore every group in flight and retire the managers (Note: [Reset retires a
        chain's managers])."""
        with _lock:
            for manager in self.layers:
                manager.clear()
                manager._drop_place()
            self._retired = [*self._retired, *(weakref.ref(m) for m in self.layers)]
            self.layers = []
            with self._copy_lock:
                self.copying.clear()
            self.maybe_unguarded = False
            self.missed = 0


def still_copying(copying: list[tuple[SwapLayerInputManager, weakref.ref[SwapTensors]]],
                  before: int) -> list[tuple[SwapLayerInputManager, SwapTensors]]:
    """Drop the entries of ``copying`` whose copy is over (in place); return ``(manager, group)``
    for the rest whose layer comes before layer ``before``, in start order."""
    found, kept = [], 0
    for entry in copying:
        group = entry[1]()
        if group is not None and group.stat is D2H:
            copying[kept] = entry
            kept += 1
            if entry[0].layer_idx < before:
                found.append((entry[0], group))
    del copying[kept:]
    return found


def _copied_chain(stem: str, by_tag: bool) -> LayerChain:
    return LayerChain(f"{stem}+copy{next(_copy_numbers)}", by_tag=by_tag)


def chain_of_tag(tag: str) -> LayerChain:
    """The chain of ``module_tag`` for managers no handle owns (created on first use)."""
    with _lock:
        chain = _chains.get(tag)
        if chain is None or not chain.by_tag:
            chain = LayerChain(tag, by_tag=True)
        return chain


def find_chain(tag: str) -> LayerChain | None:
    """The live chain named ``tag``, if any."""
    return _chains.get(tag)


def layer_map() -> dict[str, list[SwapLayerInputManager]]:
    """``{tag: [manager, ...]}`` of every chain with registered managers (copies of its lists)."""
    with _lock:
        return {chain.tag: list(chain.layers) for chain in _chains.values() if chain.layers}


def reset_chains() -> None:
    """Reset every live chain (see :func:`swap_pass.reset`); forget the chains kept by tag."""
    with _lock:
        for chain in list(_chains.values()):
            chain.reset()
        _by_tag.clear()
