"""Exceptions raised by swap_pass.

Messages read ``swap_pass.<api>: what failed. What must hold.``
"""

from __future__ import annotations

__all__ = ["HostMemoryError", "SwapDataError", "SwapStateError"]


class SwapStateError(RuntimeError):
    """A :class:`~swap_pass.SwapTensors` transition was called from the wrong state."""

    def __init__(self, api: str, current: str, expected: str, name: str | None = None) -> None:
        self.current = current
        self.expected = expected
        where = f" for {name!r}" if name else ""
        super().__init__(
            f"swap_pass.{api}: called in state {current!r}{where}. "
            f"It must be called in state {expected!r}."
        )


class HostMemoryError(RuntimeError):
    """Host memory for swapped tensors could not be had (cap reached or allocation failed)."""

    def __init__(self, api: str, needed: int, available: int, why: str) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"swap_pass.{api}: {why}: {needed} bytes needed, {available} bytes available. "
            "Raise SwapConfig.max_host_bytes, free host memory, swap fewer layers, or set "
            "SwapConfig(on_host_exhausted='keep_on_device')."
        )


class SwapDataError(RuntimeError):
    """A swapped tensor was changed while its data was (or was being moved) off the device."""
