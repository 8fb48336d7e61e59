"""Device-to-host copy bandwidth, measured once for SmartSwap's simulator and the graph's
budget mode."""

from __future__ import annotations

import torch

from swap_pass.runtime.device import is_async_device
from swap_pass.smart.profiler import now

__all__ = ["measure_copy_bandwidth"]


def measure_copy_bandwidth(device: torch.device, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Device-to-host copy bandwidth in bytes/s, timed on ``device`` (best of ``repeats``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_async_device(device))
    best = float("inf")
    for _ in range(repeats):
        if is_async_device(device):
            torch.accelerator.synchronize(device)
        t0 = now()
        dst.copy_(src)
        if is_async_device(device):
            torch.accelerator.synchronize(device)
        best = min(best, now() - t0)
    return nbytes / max(best, 1e-9)
