"""Configuration for swap_pass: one frozen dataclass of knobs, validated on construction."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["OnHostExhausted", "SwapConfig", "check_config"]


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
        max_host_bytes: Cap on host bytes the runtime may hold at once (pooled buffers included,
            counted in the blocks the host allocator sets aside: pinned buffers round up to a
            power of two). ``None`` means no cap beyond what the machine has; the buffer pool
            then still keeps at most twice the most bytes it had in use at once since the last
            ``swap_pass.reset()`` (``swap_stats().host_pool_bound_bytes``), dropping cached
            buffers beyond that. Either way, pinned memory goes back to the system only at
            ``swap_pass.reset()``: nothing in a step calls ``empty_host_cache``. Default:
            ``None``.
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
        prefetch_layers: How many layers ahead of the layer that needs it a swapped input's
            host-to-device copy starts in backward (with ``prefetch``): ``1`` keeps one layer
            input in flight back, ``2`` two, and so on; more hides slower copies and costs one
            more layer input on the device each. Default: ``1``.
        max_copies_in_flight: Most copies one model's layers may have started and not yet
            waited for, in each direction: before another starts, the oldest is waited for.
            ``None`` waits only where a reader needs the data. Default: ``None``.
    """

    max_host_bytes: int | None = None
    on_host_exhausted: OnHostExhausted | str = OnHostExhausted.ERROR
    min_swap_bytes: int = 0
    prefetch: bool = True
    pin_memory: bool = True
    use_streams: bool = True
    prefetch_layers: int = 1
    max_copies_in_flight: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_host_bytes", self.max_host_bytes, 0, allow_none=True)
        try:
            policy = OnHostExhausted(self.on_host_exhausted)
        except ValueError:
            choices = [p.value for p in OnHostExhausted]
            raise ValueError(
                f"swap_pass.SwapConfig: on_host_exhausted={self.on_host_exhausted!r} is invalid. "
                f"It must be one of {choices}."
            ) from None
        object.__setattr__(self, "on_host_exhausted", policy)
        _check_int("min_swap_bytes", self.min_swap_bytes, 0)
        for name in ("prefetch", "pin_memory", "use_streams"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"swap_pass.SwapConfig: {name}={value!r} is a {type(value).__name__}. "
                    "It must be a bool (True or False)."
                )
        _check_int("prefetch_layers", self.prefetch_layers, 1)
        _check_int("max_copies_in_flight", self.max_copies_in_flight, 1, allow_none=True)


def _check_int(name: str, value: object, least: int, *, allow_none: bool = False) -> None:
    """A byte count (``least`` 0) or a count of layers or copies (``least`` 1): an int, ``bool``
    refused although it is an ``int`` subclass."""
    if value is None and allow_none:
        return
    must = f"It must be an int >= {least}{' or None' if allow_none else ''}."
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"swap_pass.SwapConfig: {name}={value!r} is a {type(value).__name__}. {must}")
    if value < least:
        raise ValueError(f"swap_pass.SwapConfig: {name}={value!r} is invalid. {must}")


def check_config(config: object, api: str, expected: str = "swap_pass.SwapConfig") -> SwapConfig:
    """``config`` itself when it is a :class:`SwapConfig`, ``SwapConfig()`` when None.

    Raises:
        TypeError: ``config`` is anything else (a dict of knobs, say), naming ``api``.
    """
    if config is None:
        return SwapConfig()
    if not isinstance(config, SwapConfig):
        raise TypeError(
            f"swap_pass.{api}: config is a {type(config).__name__} ({config!r:.80}). It must be a "
            f"{expected}, e.g. SwapConfig(max_host_bytes=...) (or None for the defaults)."
        )
    return config
