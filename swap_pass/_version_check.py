"""Refuse to import on a torch older than the APIs swap_pass relies on."""

from __future__ import annotations

import re

import torch

# The oldest release the test suite passes on (2.11 and 2.13 checked, 2026-11-29, with
# scripts/test_torch_version.sh). torch 2.6 imports but fails 23 tests: the private autograd hook
# API ``torch._C._autograd._top_saved_tensors_default_hooks`` is missing, Dynamo fails on HF Llama
# with transformers 5, and the pipelining schedules differ.
MIN_TORCH = (2, 11)


def parse_version(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"swap_pass: cannot read torch version {version!r}.")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError naming the installed and the required torch version when too old."""
    version = version or torch.__version__
    if parse_version(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"swap_pass: torch {version} is installed. swap_pass needs torch>={need}, the oldest "
            "release its test suite passes on; install a newer torch."
        )
