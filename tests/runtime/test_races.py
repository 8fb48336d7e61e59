"""Runtime-level stream races: pinned buffer reuse, one storage in two groups.

The buffer test runs on the test accelerator with side-stream copies held until someone waits
for them; the group test runs on every device present (``device``), on the test accelerator with
its default copy delays. An unordered read, write or free the device counts fails either at
teardown (``tests/conftest.py``).
"""

from __future__ import annotations

import torch

from swap_pass import SwapTensors
from swap_pass.runtime.host_pool import host_pool
from tests.conftest import on_test_accelerator


@on_test_accelerator
def test_a_reused_host_buffer_waits_for_its_last_copy(swaptest_held):
    """Another stream's copy in still reads a released buffer; the next copy out that takes it
    must wait for that read."""
    dev = swaptest_held
    compute, other = torch.accelerator.current_stream(dev), torch.Stream(device=dev)
    buf, _ = host_pool().take(256, pin=True)
    buf.copy_(torch.arange(256, dtype=torch.uint8))
    restored = torch.empty(256, dtype=torch.uint8, device=dev)
    other.wait_stream(compute)  # after restored's allocation
    with other:
        restored.copy_(buf, non_blocking=True)  # a copy in on a stream nobody here waited on
    host_pool().release(buf, other.record_event())
    x = torch.full((64,), 3.0, device=dev)  # 256 bytes: takes the same buffer
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()
    compute.wait_stream(other)
    assert torch.equal(restored.cpu(), torch.arange(256, dtype=torch.uint8))
    assert torch.equal(x.cpu(), torch.full((64,), 3.0))


def test_one_storage_in_two_groups_is_copied_once_and_exact(device):
    """A layer returning its input: both groups hold x; the older one gives it up."""
    x = torch.randn(64, device=device)
    expected = x.cpu()
    first, second = SwapTensors([x], name="layers[0]"), SwapTensors([x], name="layers[1]")
    first.swap_to_host()
    second.swap_to_host()  # takes x over while first's copy may still run
    first.wait_d2h()       # frees nothing now
    kept_after_first = x.untyped_storage().nbytes()
    second.wait_d2h()
    freed_after_second = x.untyped_storage().nbytes() == 0
    second.swap_to_device()
    second.wait_h2d()
    first.swap_to_device()
    first.wait_h2d()
    assert torch.equal(x.cpu(), expected)
    assert kept_after_first == x.numel() * 4 and first.is_empty and freed_after_second
