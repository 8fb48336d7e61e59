"""The formulas every planner shares: bytes of a tensor, seconds of a copy and of compute.

Budget mode of ``swap_backend`` (:mod:`swap_pass.graph.budget`), SmartSwap's policy and simulator
(:mod:`swap_pass.smart.policy`, :mod:`swap_pass.smart.simulator`) and ``swap-pass plan`` take
bytes, copy times and compute times from here; each keeps its own search on top.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["BACKWARD_PER_FORWARD", "DTYPES", "FORWARD_SHARE", "compute_seconds", "copy_seconds",
           "itemsize", "tensor_bytes"]

# Dtype names the command line and the presets accept; sizes are torch's own ``dtype.itemsize``.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}

# A layer's backward takes twice its forward's FLOPs (one for each input of every matmul).
BACKWARD_PER_FORWARD = 2.0
# The forward's share of a step's compute without recompute.
FORWARD_SHARE = 1 / (1 + BACKWARD_PER_FORWARD)


def itemsize(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype``: a ``torch.dtype`` or a name of :data:`DTYPES`."""
    return (DTYPES[dtype] if isinstance(dtype, str) else dtype).itemsize


def tensor_bytes(shape: Sequence[int], dtype: str | torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * itemsize(dtype)


def compute_seconds(flops: float, flops_per_s: float) -> float:
    """Seconds ``flops`` take at ``flops_per_s``."""
    return flops / flops_per_s


def copy_seconds(nbytes: float, bytes_per_s: float) -> float:
    """Seconds a copy of ``nbytes`` takes at ``bytes_per_s``."""
    return nbytes / bytes_per_s
