"""Faults of issue 7 that swap_pass does not handle yet, shown by tests that fail today.

Note: [Writes to a freed layer input]
    The version-counter check in ``SwapTensors.wait_d2h`` catches an in-place write while the
    device-to-host copy is in flight (tests/eager/test_reliability.py::
    test_in_place_write_to_a_swapped_input_is_caught_and_named). Once the device storage is
    freed (``resize_(0)``, after the next layer ran) until the swap-in, a write to the layer
    input reaches a storage of zero bytes: on CPU the process dies with SIGSEGV before any
    Python check can run (on CUDA it is an illegal address). The issue asks for a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]

_WRITE_AFTER_FREE = textwrap.dedent("""
    import torch, swap_pass
    from swap_pass.models import LlamaConfig, LlamaStyleModel, make_batch
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=2,
                      intermediate_size=48)
    model = LlamaStyleModel(cfg)
    swap_pass.enable_swap_layer_input(model)
    cos, sin = model.cos_table[:8], model.sin_table[:8]
    h0 = model.embed(make_batch(cfg, 2, 8)[0])
    h2 = model.layers[1](model.layers[0](h0, cos, sin), cos, sin)  # layer 1 ran: h0 is freed
    assert h0.untyped_storage().nbytes() == 0
    try:
        with torch.no_grad():
            h0.mul_(2)
    except swap_pass.SwapDataError as err:
        print("SwapDataError:", err)
""")


@pytest.mark.xfail(strict=True, reason="Note: [Writes to a freed layer input]: the process "
                                       "segfaults instead of raising SwapDataError")
def test_in_place_write_after_free_is_a_clear_error():
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    proc = subprocess.run([sys.executable, "-c", _WRITE_AFTER_FREE], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-500:]}"
    assert "SwapDataError: swap_pass." in proc.stdout and "layers[0]" in proc.stdout
