"""Fixtures of the test accelerator's own tests (they run in the pass that loads it)."""

from __future__ import annotations

import pytest
import torch

from swap_pass.testing import accelerator as device_knobs

from ..conftest import ON_TEST_ACCELERATOR, TEST_ACCELERATOR_SKIP

# Every test here runs on the device (marked `accelerator`, as the device-parametrized tests).
needs_test_accelerator = [pytest.mark.accelerator,
                          pytest.mark.skipif(not ON_TEST_ACCELERATOR, reason=TEST_ACCELERATOR_SKIP)]

# A delay no test step reaches: a copy nobody waited for has surely not run when it is read,
# and a copy someone waits for runs at once, so these tests depend on no timing.
LONG_DELAY_MS = 60_000.0


@pytest.fixture
def dev() -> torch.device:
    """Device 0 of the test accelerator; its settings are back to their defaults afterwards."""
    defaults = device_knobs.delay_settings()
    yield torch.device(device_knobs.DEVICE_TYPE, 0)
    device_knobs.fail_nth_resize(0)
    device_knobs.synchronize()
    device_knobs.set_delay(bool(defaults["enabled"]), defaults["min_ms"], defaults["max_ms"])
    device_knobs.set_seed(int(defaults["seed"]))
    device_knobs.set_order_check(True)


@pytest.fixture
def long_delay(dev) -> torch.device:
    """Like ``dev``, with side-stream copies held until someone waits for them."""
    device_knobs.set_delay(True, LONG_DELAY_MS, LONG_DELAY_MS)
    return dev
