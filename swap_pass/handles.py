"""``SwapHandle``: what an enabling call returns, and how it is undone.

``enable_swap_layer_input``, ``compile_layers`` and ``integrations.megatron.enable`` each return
a handle. All of them undo the same way::

    handle = swap_pass.enable_swap_layer_input(model)
    ...
    handle.remove()          # restores exactly what the call changed; a second call does nothing

    with swap_pass.enable_swap_layer_input(model):   # or: removed on leaving the block
        ...
"""

from __future__ import annotations

import abc
from typing import TypeVar

__all__ = ["SwapHandle"]

_Handle = TypeVar("_Handle", bound="SwapHandle")


class SwapHandle(abc.ABC):
    """Base of the handles: ``remove()`` is idempotent, ``with handle:`` removes on exit.

    Subclasses say whether they are still in effect (:attr:`active`), undo their changes once
    (:meth:`_remove`, only called while active) and name their fields for the repr
    (:meth:`_repr_fields`).
    """

    @property
    @abc.abstractmethod
    def active(self) -> bool:
        """True until :meth:`remove` ran."""

    @abc.abstractmethod
    def _remove(self) -> None:
        """Undo what the enabling call changed (called once, while :attr:`active`)."""

    def _repr_fields(self) -> dict[str, object]:
        """The fields the repr shows before ``active``."""
        return {}

    def remove(self) -> None:
        """Undo what the enabling call changed; nothing once it was undone."""
        if self.active:
            self._remove()

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        fields = {**self._repr_fields(), "active": self.active}
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in fields.items())})"
