"""Per-layer swap bookkeeping: which groups of a layer are off the device, in micro-batch order.

Forward of layer ``i`` (MindSpeed's protocol, driven by the eager wrappers)::

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

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch

from swap_pass.config import SwapConfig, check_config
from swap_pass.opt_out import swap_allowed
from swap_pass.runtime.device import is_async_device
from swap_pass.runtime.host_pool import block_bytes, preflight
from swap_pass.runtime.ownership import swappable_layer_inputs
from swap_pass.runtime.skips import SkipReason, record_skip
from swap_pass.runtime.subclasses import claim_not_plain
from swap_pass.runtime.swap_tensors import (
    D2H,
    DEVICE,
    HOST,
    SwapTensors,
    is_valid_for_swap,
    restore_or_keep,
)

__all__ = ["SwapLayerInputManager"]


class _TagToken:
    """Shared by the managers of one tag, so that a copy of them all gets one new tag.

    ``copy.deepcopy`` and ``pickle`` copy a shared object once per copy operation (their memo),
    so every manager of one copied model lands under the same fresh tag, distinct from the
    original's (see Note: [Copies of an enabled model] in ``swap_pass/eager/enable.py``).
    """

    _counter: ClassVar[itertools.count] = itertools.count(1)
    _live: ClassVar[weakref.WeakValueDictionary[str, _TagToken]] = weakref.WeakValueDictionary()

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def of(cls, name: str) -> _TagToken:
        token = cls._live.get(name)
        if token is None:
            token = cls._live[name] = cls(name)
        return token

    def __reduce__(self) -> tuple:
        return (_fresh_tag, (self.name.split("+copy")[0],))


def _fresh_tag(stem: str) -> _TagToken:
    return _TagToken.of(f"{stem}+copy{next(_TagToken._counter)}")


def _rebuild_manager(token: _TagToken, custom_check_fn, prefetch: bool,
                     config: SwapConfig) -> SwapLayerInputManager:
    return SwapLayerInputManager(token.name, custom_check_fn, prefetch, config)


# A tag's list of copies that may still run is compacted by every copying_earlier() call; one
# that no caller scans is compacted when it grows past this many entries.
_COMPACT_COPYING_AT = 64


def _still_copying(copying: list[tuple[SwapLayerInputManager, weakref.ref[SwapTensors]]],
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


def _opted_out(tensors: list[torch.Tensor], where: str) -> list[torch.Tensor]:
    """Count ``tensors`` as kept inside :func:`swap_pass.no_swap`; claim none of them."""
    for t in tensors:
        record_skip(SkipReason.NO_SWAP, t.numel() * t.element_size(), where=where)
    return []


def _renumber(layers: list[SwapLayerInputManager]) -> None:
    """Give each manager of one tag its place in ``layers`` (call with ``_map_lock`` held).

    Places are plain attributes, set here at every change of ``manager_map`` (construction,
    re-registration, unregister, reset) rather than looked up at each of the several reads per
    layer call.
    """
    last = len(layers) - 1
    for idx, manager in enumerate(layers):
        manager._set_place(idx, layers[idx - 1] if idx > 0 else None,
                           layers[idx + 1] if idx < last else None)


class SwapLayerInputManager:
    """Swap bookkeeping of one layer instance, registered under ``module_tag``.

    Args:
        module_tag: Groups managers into one layer sequence (one model, or one block type).
            Default: ``"default"``.
        custom_check_fn: Extra predicate for which tensors may be swapped. Default: ``None``.
        prefetch: Whether backward should start this layer's H2D one layer ahead. Default: ``True``.
        config: Runtime knobs shared by the layer's groups. Default: ``SwapConfig()``.

    Attributes:
        manager_map: Class-level ``{module_tag: [manager, ...]}`` in construction order.
        layer_idx: This manager's position in its tag's list.
        previous: The manager of the layer before this one, if any (None once unregistered).
        next: The manager of the layer after this one, if any (None once unregistered).
        is_last_layer: True for the last layer of the tag, whose input is never swapped.
        name: The layer's name in warnings and errors: ``"<module_tag>.layers[<layer_idx>]"``.
        batch_stack: FIFO of this layer's groups in flight, one per micro-batch.
        layer_parameter: A weak reference to the layer's first parameter, kept by the eager
            wrappers for their device check (see ``check_device`` in
            ``swap_pass/eager/_layer_io.py``); None until the first call.
    """

    manager_map: ClassVar[dict[str, list[SwapLayerInputManager]]] = {}
    _map_lock: ClassVar[threading.RLock] = threading.RLock()
    # Managers that reset() dropped, per tag in layer order: re-registered on their next use.
    _retired: ClassVar[dict[str, list[weakref.ref[SwapLayerInputManager]]]] = {}
    # Per tag, ``(manager, weak reference to group)`` for the groups whose device-to-host copy a
    # manager started and that may still be in "d2h", in start order: finding earlier layers'
    # copies at every layer call walks these, not every earlier manager's FIFO. Weak: a group
    # whose copy is over must not stay alive (with its tensors) until the next scan.
    _copying: ClassVar[dict[str, list[tuple[SwapLayerInputManager, weakref.ref[SwapTensors]]]]] = {}

    def __init__(
        self,
        module_tag: str = "default",
        custom_check_fn: Callable[[torch.Tensor], bool] | None = None,
        prefetch: bool = True,
        config: SwapConfig | None = None,
    ) -> None:
        self.module_tag = module_tag
        self._token = _TagToken.of(module_tag)
        self.custom_check_fn = custom_check_fn
        self.config = (SwapConfig(prefetch=prefetch) if config is None
                       else check_config(config, "SwapLayerInputManager"))
        self.prefetch_enabled = prefetch and self.config.prefetch
        self.batch_stack: list[SwapTensors] = []
        self.layer_parameter: weakref.ref[torch.nn.Parameter] | None = None
        self._preflighted: set[int] = set()
        with self._map_lock:
            layers = self.manager_map.setdefault(module_tag, [])
            layers.append(self)
            _renumber(layers)

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
        return (_rebuild_manager, (self._token, self.custom_check_fn, self.prefetch_enabled,
                                   self.config))

    # --- position in the layer sequence -------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Number of managers under this manager's tag."""
        return len(self.manager_map.get(self.module_tag, ()))

    def _set_place(self, idx: int, previous: SwapLayerInputManager | None,
                   next: SwapLayerInputManager | None, *, registered: bool = True) -> None:
        self.layer_idx = idx
        self.previous = previous
        self.next = next
        self.is_last_layer = registered and next is None
        self.name = f"{self.module_tag}.layers[{idx}]"
        self._in_map = registered

    def _drop_place(self) -> None:
        """Out of ``manager_map``: no neighbours until registered again (index kept)."""
        self._set_place(self.layer_idx, None, None, registered=False)

    def ensure_registered(self) -> None:
        """Called at each layer call: after :func:`swap_pass.reset`, register again.

        The managers of the tag that reset() dropped come back together, in their old order,
        so that the first step after a reset swaps exactly like the steps before it.
        """
        if self._in_map:  # every call but the first after a reset
            return
        with self._map_lock:
            if self._in_map:
                return
            retired = [ref() for ref in self._retired.pop(self.module_tag, [])]
            peers = [m for m in retired if m is not None]
            for manager in peers if self in peers else [*peers, self]:
                layers = self.manager_map.setdefault(self.module_tag, [])
                if manager not in layers:
                    layers.append(manager)
            _renumber(self.manager_map[self.module_tag])

    def unregister(self) -> None:
        """Drop this manager from ``manager_map`` (restoring its groups) and renumber the rest."""
        self.clear()
        with self._map_lock:
            layers = self.manager_map.get(self.module_tag, [])
            if self in layers:
                layers.remove(self)
            copying = self._copying.get(self.module_tag, [])
            copying[:] = [entry for entry in copying if entry[0] is not self]
            self._drop_place()
            _renumber(layers)
            if not layers:
                self.manager_map.pop(self.module_tag, None)

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
        copying = self._copying.get(self.module_tag)
        if copying is None:
            copying = self._copying.setdefault(self.module_tag, [])
        copying.append((self, weakref.ref(group)))
        if len(copying) > _COMPACT_COPYING_AT:  # callers that never scan (FBOverlap): stay small
            _still_copying(copying, 0)
        return group

    def copying_earlier(self) -> list[tuple[SwapLayerInputManager, SwapTensors]]:
        """``(manager, group)`` for earlier layers' groups whose device-to-host copy runs.

        Nearest layer first, each layer's groups in micro-batch order; empty when this manager
        is not registered.
        """
        copying = self._copying.get(self.module_tag)
        if not copying or not self._in_map:
            return []
        found = _still_copying(copying, self.layer_idx)
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
        if group.stat is not DEVICE:
            group.restore()
        if group in self.batch_stack:  # groups compare by identity
            self.batch_stack.remove(group)
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
        """The managers registered under ``module_tag``, in layer order (a copy)."""
        with cls._map_lock:
            return list(cls.manager_map.get(module_tag, ()))

    @classmethod
    def reset_all(cls) -> None:
        """Restore every group of every manager and empty ``manager_map``.

        A manager whose layer is still alive registers again at its next call
        (:meth:`ensure_registered`), with its peers in their old order.
        """
        with cls._map_lock:
            for tag, layers in list(cls.manager_map.items()):
                for manager in layers:
                    manager.clear()
                    manager._drop_place()
                cls._retired[tag] = [weakref.ref(m) for m in layers]
            cls.manager_map.clear()
            cls._copying.clear()
