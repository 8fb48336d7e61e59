"""Shared fixtures: every test starts and ends with an empty runtime, on each device present."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass.runtime.device import accelerator_type

ACCELERATOR = accelerator_type()
HAS_ACCELERATOR = ACCELERATOR != "cpu"
NO_ACCELERATOR_REASON = "needs an accelerator (CUDA/NPU/XPU); this machine has only a CPU"

# CPU always; the accelerator too where one exists (skipped with the reason otherwise).
DEVICES = [
    "cpu",
    pytest.param(
        ACCELERATOR if HAS_ACCELERATOR else "cuda",
        marks=[pytest.mark.accelerator,
               pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)],
    ),
]


@pytest.fixture(autouse=True)
def _clean_runtime():
    swap_pass.reset()
    yield
    swap_pass.reset()


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(params=[True, False], ids=["streams", "no_streams"])
def use_streams(request) -> bool:
    return request.param
