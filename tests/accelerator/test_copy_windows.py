"""Copy windows on the test accelerator: the compute each side-stream copy can hide behind.

Every way in that swaps layer inputs starts each copy out at least one layer's forward before
the compute stream waits for it (the eager protocol two: Note: [The copy out starts at the
layer's entry] in ``swap_pass/eager/_protocol.py``), and each prefetch at least one layer's
backward before its reader; the one copy back that is not a prefetch (the eager protocol's
restore at the first guard of a backward) is counted apart. Measured in each way's own layers
(``swap_pass/tools/bench/windows.py``).
"""

from __future__ import annotations

import pytest
import torch

from swap_pass.testing import accelerator as device_knobs
from swap_pass.tools.bench.windows import CFG, format_windows, measure_way

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

LAYER_INPUT_WAYS = ["enable", "decorators", "apply_swap_pass", "swap_backend[aot_eager]",
                    "compile_layers", "swap_backend[inductor]"]
EAGER_PROTOCOL = {"enable", "decorators", "compile_layers"}  # run_layer in eager/_protocol.py
RESTORE_FIRST = EAGER_PROTOCOL | {"apply_swap_pass"}  # the backward's first copy back at once


def test_a_window_counts_the_compute_issued_on_the_stream_that_waits(long_delay) -> None:
    dev = long_delay
    side = torch.Stream(device=dev)
    x = torch.ones(1024, device=dev)
    host = torch.empty(1024, pin_memory=True)
    side.wait_stream(torch.accelerator.current_stream(dev))
    device_knobs.record_copy_windows(True)
    try:
        with side:
            host.copy_(x, non_blocking=True)
        y = x * 2
        y = y + 1
        y = y.sin()
        torch.accelerator.current_stream(dev).wait_stream(side)
        z = y * 3  # after the wait: not in the window
        windows = device_knobs.copy_windows()
    finally:
        device_knobs.record_copy_windows(False)
    assert z.sum().item() != 0
    assert [(w.direction, w.ops, w.closed_by) for w in windows] == [("d2h", 3, "stream 0")]
    assert windows[0].compute_bytes == 3 * 2 * 1024 * 4  # each op reads 4 KiB and writes 4 KiB


@pytest.mark.parametrize("way", LAYER_INPUT_WAYS)
def test_every_layer_input_copy_hides_behind_at_least_one_layer(dev, way: str) -> None:
    if way == "swap_backend[inductor]" and device_knobs.inductor_reason() is not None:
        pytest.skip(device_knobs.inductor_reason())
    device_knobs.set_delay(True, 1.0, 2.0)
    row = measure_way(way, dev)
    print(format_windows([row]))
    swapped = CFG.num_layers - 1
    assert len(row.d2h) == swapped and len(row.h2d) == swapped
    # One op of slack: Inductor may fuse a layer's last kernel with the next code (the last
    # layer's residual add into the head's norm), one kernel fewer than the layers' spacing.
    fwd, bwd = row.layer_ops
    layers_out = 2 if way in EAGER_PROTOCOL else 1
    assert min(row.d2h) >= layers_out - 1.0 / fwd, row
    assert min(row.prefetches) >= 1.0 - 1.0 / bwd, row
    restores = len(row.h2d) - len(row.prefetches)
    assert restores == (1 if way in RESTORE_FIRST else 0), row
