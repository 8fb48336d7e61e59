"""Test support: what a test of a training step with swap needs, and nothing the library imports.

* :func:`load_test_accelerator` (:mod:`swap_pass.testing.accelerator`): a CPU-backed asynchronous
  PrivateUse1 device whose side-stream copies run later on worker threads, whose caching allocator
  hands a freed block back to its stream at once, poisoned, and which counts every read, write or
  free no stream wait orders. A missing or misplaced wait fails an exactness test there.
* :func:`inject_failures` (:mod:`swap_pass.testing.faults`): make the runtime's Nth free, copy,
  re-allocation or host buffer request fail, to test that nothing is lost part-way.
* :func:`count_device_syncs` / :func:`no_device_sync` (:mod:`swap_pass.testing.device_syncs`):
  count the calls that make the host wait for the device inside a step.

The CPU stream model that stood in for an asynchronous device here before (``stream_model``) is
retired: the test accelerator catches every missing wait it caught, and one it could not see
(``docs/reliability.md``, section 12).
"""

from __future__ import annotations

from swap_pass.testing.accelerator import load_test_accelerator
from swap_pass.testing.device_syncs import DeviceSyncs, count_device_syncs, no_device_sync
from swap_pass.testing.faults import FailureInjector, InjectedFailure, inject_failures

__all__ = [
    "DeviceSyncs",
    "FailureInjector",
    "InjectedFailure",
    "count_device_syncs",
    "inject_failures",
    "load_test_accelerator",
    "no_device_sync",
]

# The CPU stream model's names, retired with it.
_RETIRED = frozenset({"stream_model", "StreamModel", "ModelStream", "ModelEvent",
                      "StreamRaceError"})


def __getattr__(name: str):
    if name in _RETIRED:
        raise AttributeError(
            f"swap_pass.testing.{name}: the CPU stream model was retired. The test accelerator "
            "(swap_pass.testing.load_test_accelerator()) catches every missing or misplaced "
            "stream wait the model caught, and more; run the test on its device instead (see "
            "docs/reliability.md, section 12).")
    raise AttributeError(f"module 'swap_pass.testing' has no attribute {name!r}")
