"""The limits a capacity search runs under: device memory (real or virtual) and host memory.

* On an accelerator the cap is real: the backend's ``set_per_process_memory_fraction`` (CUDA,
  Ascend's ``torch_npu``, XPU where the build has it) makes the allocator refuse more, and an
  out-of-memory error is a size that does not fit. Peaks come from the allocator's own counter.
* On CPU there is no device memory to cap: the cap is virtual. A size fits when the model state
  (counted from the model) plus the step's measured peak above its start is within the cap.
* Host memory is a limit for the methods that swap: ``max_host_bytes`` when given, else the
  memory the machine has available now.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import torch

from swap_pass.runtime.host_pool import available_host_bytes, meminfo_bytes

__all__ = ["available_host_bytes", "device_memory_cap", "device_total_bytes", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"64MiB"`` -> 67108864; plain integers are bytes; KB/MB/GB are powers of 10, KiB/MiB/GiB
    of 2.

    Raises:
        ValueError: naming the accepted forms.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"swap_pass.tools.capacity: memory size {text!r} is invalid. "
                         "It must be a positive number of bytes, optionally with a unit: "
                         "KB, MB, GB (10^3...) or KiB, MiB, GiB (2^10...).")
    return int(float(match.group(1)) * _UNITS[unit])


def device_total_bytes(device: torch.device) -> int:
    """The device's memory; on CPU the machine's (``MemTotal``)."""
    if device.type == "cpu":
        return meminfo_bytes("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return module.get_device_properties(index).total_memory


@contextlib.contextmanager
def device_memory_cap(device: torch.device, cap_bytes: int) -> Iterator[bool]:
    """Cap the process's allocator on ``device`` at ``cap_bytes`` for the body; yields True when
    the cap is virtual (CPU: nothing is enforced, the caller compares peaks).

    Raises:
        ValueError: the backend has no ``set_per_process_memory_fraction``.
    """
    if device.type == "cpu":
        yield True
        return
    module = torch.get_device_module(device.type)
    setter = getattr(module, "set_per_process_memory_fraction", None)
    if setter is None:
        raise ValueError(f"swap_pass.tools.capacity: torch.{device.type} has no "
                         "set_per_process_memory_fraction, so the device memory cannot be capped. "
                         "It must have one for a real cap.")
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    total = device_total_bytes(torch.device(device.type, index))
    setter(min(cap_bytes / total, 1.0), index)
    try:
        yield False
    finally:
        setter(1.0, index)
