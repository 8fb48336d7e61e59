"""Per-layer swap bookkeeping: which groups of a layer are off the device, in micro-batch order.

Forward of layer ``i`` (the seed's protocol, driven by the eager wrappers)::

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

import threading
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch

from swap_pass.config import SwapConfig, check_config
from swap_pass.runtime.host_pool import preflight
from swap_pass.runtime.swap_tensors import SwapState, SwapTensors

__all__ = ["SwapLayerInputManager"]


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
        batch_stack: FIFO of this layer's groups in flight, one per micro-batch.
    """

    manager_map: ClassVar[dict[str, list[SwapLayerInputManager]]] = {}
    _map_lock: ClassVar[threading.RLock] = threading.RLock()

    def __init__(
        self,
        module_tag: str = "default",
        custom_check_fn: Callable[[torch.Tensor], bool] | None = None,
        prefetch: bool = True,
        config: SwapConfig | None = None,
    ) -> None:
        self.module_tag = module_tag
        self.custom_check_fn = custom_check_fn
        self.config = (SwapConfig(prefetch=prefetch) if config is None
                       else check_config(config, "SwapLayerInputManager"))
        self.prefetch_enabled = prefetch and self.config.prefetch
        self.batch_stack: list[SwapTensors] = []
        self._preflighted: set[int] = set()
        with self._map_lock:
            layers = self.manager_map.setdefault(module_tag, [])
            self.layer_idx = len(layers)
            layers.append(self)

    def __repr__(self) -> str:
        return (f"SwapLayerInputManager(module_tag={self.module_tag!r}, layer_idx={self.layer_idx}, "
                f"num_layers={self.num_layers}, in_flight={len(self.batch_stack)})")

    # --- position in the layer sequence -------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Number of managers under this manager's tag."""
        return len(self.manager_map.get(self.module_tag, ()))

    @property
    def is_last_layer(self) -> bool:
        """True for the last layer of the tag, whose input is never swapped."""
        return self.layer_idx == self.num_layers - 1

    @property
    def previous(self) -> SwapLayerInputManager | None:
        """The manager of the layer before this one, if any."""
        return self.manager_map[self.module_tag][self.layer_idx - 1] if self.layer_idx > 0 else None

    @property
    def next(self) -> SwapLayerInputManager | None:
        """The manager of the layer after this one, if any."""
        return None if self.is_last_layer else self.manager_map[self.module_tag][self.layer_idx + 1]

    def unregister(self) -> None:
        """Drop this manager from ``manager_map`` (discarding its groups) and renumber the rest."""
        self.clear()
        with self._map_lock:
            layers = self.manager_map.get(self.module_tag, [])
            if self in layers:
                layers.remove(self)
            for idx, manager in enumerate(layers):
                manager.layer_idx = idx
            if not layers:
                self.manager_map.pop(self.module_tag, None)

    # --- forward side -------------------------------------------------------------------------

    def swap_out(self, tensors: Iterable[torch.Tensor], name: str | None = None) -> SwapTensors:
        """Queue a group for ``tensors`` (one micro-batch) and start its device-to-host copy.

        The first layer's first group of each size runs :meth:`preflight_for` first.
        """
        group = SwapTensors(tensors, custom_check_fn=self.custom_check_fn, config=self.config,
                            name=name or f"{self.module_tag}.layers[{self.layer_idx}]")
        if self.layer_idx == 0:
            self.preflight_for(group.nbytes)
        self.batch_stack.append(group)
        group.swap_to_host()
        return group

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
            if group.stat == SwapState.D2H:
                group.wait_d2h()

    # --- backward side ------------------------------------------------------------------------

    def prefetch(self, group: SwapTensors | None = None) -> SwapTensors | None:
        """Start the host-to-device copy of ``group`` (default: the oldest group on the host)."""
        if group is None:
            group = next((g for g in self.batch_stack if g.stat == SwapState.HOST), None)
        if group is not None and group.stat == SwapState.HOST:
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
        group.restore()
        self._forget(group)
        return group

    # --- cleanup ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Discard every group in flight (their host buffers go back to the pool)."""
        while self.batch_stack:
            self.batch_stack.pop(0).discard()

    def discard(self, group: SwapTensors) -> None:
        """Discard one group whose tensors will never be read again (its graph was freed)."""
        group.discard()
        self._forget(group)

    def _forget(self, group: SwapTensors) -> None:
        for idx, g in enumerate(self.batch_stack):
            if g is group:
                del self.batch_stack[idx]
                return

    # --- class-level helpers ------------------------------------------------------------------

    @classmethod
    def managers(cls, module_tag: str = "default") -> list[SwapLayerInputManager]:
        """The managers registered under ``module_tag``, in layer order (a copy)."""
        with cls._map_lock:
            return list(cls.manager_map.get(module_tag, ()))

    @classmethod
    def reset_all(cls) -> None:
        """Discard every group of every manager and empty ``manager_map``."""
        with cls._map_lock:
            for layers in list(cls.manager_map.values()):
                for manager in layers:
                    manager.clear()
            cls.manager_map.clear()
