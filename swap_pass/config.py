"""Configuration for swap_pass: one frozen dataclass of knobs, validated on construction."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["OnHostExhausted", "SwapConfig"]


class OnHostExhausted(str, enum.Enum):
    """What the runtime does when a host buffer cannot be had.

    ``ERROR`` raises :class:`swap_pass.HostMemoryError` naming the bytes needed and available.
    ``KEEP_ON_DEVICE`` warns once and leaves that group's tensors on the device.
    """

    ERROR = "error"
    KEEP_ON_DEVICE = "keep_on_device"


@dataclasses.dataclass(frozen=True)
class SwapConfig:
    """Knobs shared by every way into swap_pass.

    Args:
        max_host_bytes: Cap on host bytes the runtime may hold at once (pooled buffers included).
            ``None`` means no cap beyond what the machine has. Default: ``None``.
        on_host_exhausted: ``"error"`` or ``"keep_on_device"``; see :class:`OnHostExhausted`.
            Default: ``"error"``.
        min_swap_bytes: Storages smaller than this stay on the device; moving them costs more
            than it saves. Default: ``0``.
        prefetch: Start a layer's host-to-device copy one layer ahead in backward, instead of
            when the layer itself needs it. Default: ``True``.
        pin_memory: Use pinned (page-locked) host buffers when an accelerator is present, so
            copies are truly asynchronous. Ignored on CPU. Default: ``True``.
        use_streams: Run copies on side streams when an accelerator is present. ``False``
            runs them on the compute stream (useful to rule out races). Default: ``True``.
    """

    max_host_bytes: int | None = None
    on_host_exhausted: OnHostExhausted | str = OnHostExhausted.ERROR
    min_swap_bytes: int = 0
    prefetch: bool = True
    pin_memory: bool = True
    use_streams: bool = True

    def __post_init__(self) -> None:
        if self.max_host_bytes is not None and (
            not isinstance(self.max_host_bytes, int) or self.max_host_bytes < 0
        ):
            raise ValueError(
                f"swap_pass.SwapConfig: max_host_bytes={self.max_host_bytes!r} is invalid. "
                "It must be None or an int >= 0."
            )
        try:
            policy = OnHostExhausted(self.on_host_exhausted)
        except ValueError:
            choices = [p.value for p in OnHostExhausted]
            raise ValueError(
                f"swap_pass.SwapConfig: on_host_exhausted={self.on_host_exhausted!r} is invalid. "
                f"It must be one of {choices}."
            ) from None
        object.__setattr__(self, "on_host_exhausted", policy)
        if not isinstance(self.min_swap_bytes, int) or self.min_swap_bytes < 0:
            raise ValueError(
                f"swap_pass.SwapConfig: min_swap_bytes={self.min_swap_bytes!r} is invalid. "
                "It must be an int >= 0."
            )
