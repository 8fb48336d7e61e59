"""Shared fixtures: every test starts and ends with an empty runtime, on each device present."""

from __future__ import annotations

import os

import pytest
import torch

import swap_pass
from swap_pass.runtime.device import accelerator_type
from swap_pass.testing import accelerator as device_knobs
from swap_pass.testing import load_test_accelerator
from swap_pass.testing.accelerator import TestAcceleratorUnavailable

# SWAP_PASS_TEST_ACCELERATOR=1: load the CPU-backed test accelerator ("swaptest") before anything
# asks which accelerator is present, so the tests parametrized over `device` run on it. Nothing
# else loads it: once registered, it is the accelerator of the whole process.
TEST_ACCELERATOR_ENV = "SWAP_PASS_TEST_ACCELERATOR"
TEST_ACCELERATOR_REQUESTED = os.environ.get(TEST_ACCELERATOR_ENV, "") not in ("", "0")
TEST_ACCELERATOR_SKIP = (f"the test accelerator loads only in its own pass "
                         f"({TEST_ACCELERATOR_ENV}=1)")
if TEST_ACCELERATOR_REQUESTED:
    try:
        load_test_accelerator()
    except TestAcceleratorUnavailable as exc:
        TEST_ACCELERATOR_SKIP = str(exc)

ACCELERATOR = accelerator_type()
HAS_ACCELERATOR = ACCELERATOR != "cpu"
ON_TEST_ACCELERATOR = ACCELERATOR == device_knobs.DEVICE_TYPE
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


# A delay no test step reaches: a side-stream copy runs only once someone waits for it, so copies
# run in the order of the waits, the same in every run.
HELD_COPIES_MS = 60_000.0


# The marks of a test that needs the test accelerator itself (its two devices, its delay settings,
# its order check): marked `accelerator`, it runs in that device's pass and is skipped with the
# reason elsewhere. A module's `pytestmark`, or one test's through `on_test_accelerator`.
NEEDS_TEST_ACCELERATOR = [pytest.mark.accelerator,
                          pytest.mark.skipif(not ON_TEST_ACCELERATOR, reason=TEST_ACCELERATOR_SKIP)]


def on_test_accelerator(test):
    """Mark ``test`` with :data:`NEEDS_TEST_ACCELERATOR`."""
    for mark in NEEDS_TEST_ACCELERATOR:
        test = mark(test)
    return test


def _close_active_smartswaps() -> None:
    """A test that failed inside ``with SmartSwap(...)`` leaves no hooks to the next one
    (``swap_pass.reset()`` keeps an active SmartSwap working)."""
    from swap_pass.state import active_smart_swaps as _active

    for smart in list(_active):
        smart.close()


@pytest.fixture(autouse=True)
def _nothing_unordered(request):
    """On the test accelerator, every test leaves its order counters (unordered reads, writes
    and frees) where it found them, its runtime reset included, but one marked
    ``unordered_on_purpose``."""
    if not ON_TEST_ACCELERATOR or "unordered_on_purpose" in request.keywords:
        yield
        return
    before = device_knobs.order_counters()
    yield
    device_knobs.synchronize()
    after = device_knobs.order_counters()
    assert after == before, f"the test accelerator counted work out of order: {before} -> {after}"


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(params=[True, False], ids=["streams", "no_streams"])
def use_streams(request) -> bool:
    return request.param


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` for one test (compile and run).

    Inductor's CPU code for an embedding's backward adds rows into the weight gradient with
    atomic adds from several threads, so the same compiled graph gives a gradient whose last bits
    change from run to run. With deterministic algorithms Inductor calls ATen's serial
    ``index_put_`` there instead, and a compile can be compared bitwise with another."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def swaptest() -> torch.device:
    """Device 0 of the test accelerator (device 1 is ``torch.device("swaptest", 1)``), for a test
    marked with :data:`NEEDS_TEST_ACCELERATOR`; its delay settings are back to their defaults
    afterwards."""
    defaults = device_knobs.delay_settings()
    yield torch.device(device_knobs.DEVICE_TYPE, 0)
    device_knobs.synchronize()
    device_knobs.set_delay(bool(defaults["enabled"]), defaults["min_ms"], defaults["max_ms"])
    device_knobs.set_seed(int(defaults["seed"]))


@pytest.fixture
def swaptest_held(swaptest) -> torch.device:
    """Like ``swaptest``, with every side-stream copy held until someone waits for it."""
    device_knobs.set_delay(True, HELD_COPIES_MS, HELD_COPIES_MS)
    return swaptest


@pytest.fixture(autouse=True)
def _clean_runtime(_nothing_unordered):
    _close_active_smartswaps()
    swap_pass.reset()
    yield
    _close_active_smartswaps()
    swap_pass.reset()
