"""``LayerChain``: the ordered per-layer managers of one model, and what they share.

Who owns what (the eager paths)::

    SwapLayerInputHandle (enable_swap_layer_input)  ->  LayerChain  ->  SwapLayerInputManager, ...
    decorated layers, one module_tag                ->  LayerChain  (kept by tag, see below)
    SwapLayerInputManager                           ->  its FIFO of SwapTensors groups in flight

A chain numbers its managers (each manager's ``layer_idx``, ``previous``, ``next``,
``is_last_layer``), lists the device-to-host copies its managers started that may still run
(``copying``), and carries the per-step flags of the protocol in ``swap_pass/eager/_protocol.py``.
A handle owns the chain of its model: the chain lives as long as the handle or the model's
managers. Managers built without a chain (MindSpeed's decorators, direct construction) join the
chain of their ``module_tag``, which this module keeps until :func:`swap_pass.reset`.
``SwapLayerInputManager.manager_map`` is a read-only view of every live chain.

Note: [Reset retires a chain's managers]
    :func:`swap_pass.reset` restores every group in flight and empties every chain: its managers
    are kept only weakly (``_retired``) and leave ``manager_map``. A manager whose layer is still
    alive joins its chain again at its next call (:meth:`LayerChain.rejoin`), together with its
    peers, in their old order, so the first step after a reset swaps exactly like the steps
    before it, and managers of layers that died meanwhile are gone. Chains kept by tag are
    dropped from this module at a reset: their managers keep them.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING

from swap_pass.runtime.swap_tensors import D2H, SwapTensors

if TYPE_CHECKING:
    from swap_pass.runtime.manager import SwapLayerInputManager

__all__ = ["LayerChain", "chain_of_tag", "chains", "find_chain", "layer_map", "reset_chains",
           "still_copying"]

# One lock for every chain's membership and for the two tables below: registration is rare
# (construction, enable, remove, the first call after a reset), the swap path takes no lock.
_lock = threading.RLock()
# Every live chain by tag: what manager_map shows. Weak: a chain lives as long as its owner.
_chains: weakref.WeakValueDictionary[str, LayerChain] = weakref.WeakValueDictionary()
# The chains no handle owns (decorators, managers built directly), kept until reset().
_by_tag: dict[str, LayerChain] = {}
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


def chains() -> list[LayerChain]:
    """Every live chain, oldest first."""
    with _lock:
        return list(_chains.values())


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
