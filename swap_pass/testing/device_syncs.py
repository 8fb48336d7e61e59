"""A spy for calls that make the host wait for a device, for tests of a training step.

A swap hides its copies behind compute only while the host keeps queueing work: any call that
waits for the device in a step's forward or backward (a device or stream synchronize, an event
synchronize, a blocking copy to the host, ``.item()``, ``torch.accelerator.empty_host_cache()``,
which frees pinned blocks with ``cudaFreeHost``, or ``elapsed_time`` on torch_npu, which flushes
every task queue) stalls the whole pipeline. :func:`count_device_syncs` counts them inside its
body, on the device it is given:

* the test accelerator (``swap_pass.testing.load_test_accelerator()``) counts every host wait in
  its runtime (``memory_stats()["host_syncs"]``: synchronizes of the device, a stream or an
  event, blocking copies to the host, ``.item()``) and every ``elapsed_time``
  (``"elapsed_time_calls"``, counted as a wait since the device stands in for torch_npu);
* CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` reports each synchronizing CUDA call as a
  warning, which the spy counts;
* every device: ``torch.accelerator.empty_host_cache`` and ``torch.accelerator.synchronize`` are
  wrapped while the body runs (on the test accelerator the latter is counted by the device).

Use it around the steady-state steps of a test and assert ``syncs.count == 0``;
:func:`no_device_sync` raises where one happened, naming them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch

__all__ = ["DeviceSyncs", "count_device_syncs", "no_device_sync"]

_DEVICE_COUNTERS = ("host_syncs", "elapsed_time_calls")


@dataclasses.dataclass
class DeviceSyncs:
    """What :func:`count_device_syncs` saw: each call that can wait for the device, by kind."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def count(self) -> int:
        """All such calls together."""
        return sum(self.calls.values())

    def add(self, kind: str, n: int = 1) -> None:
        if n:
            self.calls[kind] = self.calls.get(kind, 0) + n


def _test_device_counts(device: torch.device) -> dict[str, int] | None:
    """The test accelerator's wait counters of ``device``, or None for another device."""
    from swap_pass.testing import accelerator as _test_accelerator

    if device.type != _test_accelerator.DEVICE_TYPE:
        return None
    stats = _test_accelerator.memory_stats(device.index or 0)
    return {k: stats.get(k, 0) for k in _DEVICE_COUNTERS}


@contextlib.contextmanager
def _wrapped(module: object, name: str, spy: DeviceSyncs) -> Iterator[None]:
    """``module.name`` counted in ``spy`` while the body runs (nothing where it is missing)."""
    original = getattr(module, name, None)
    if original is None:
        yield
        return

    def counted(*args, **kwargs):
        spy.add(name)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _cuda_sync_warnings(spy: DeviceSyncs) -> Iterator[None]:
    """Count CUDA's synchronizing calls through its sync debug mode."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    spy.add("cuda_sync", sum("synchroniz" in str(w.message) for w in seen))


@contextlib.contextmanager
def count_device_syncs(device: torch.device | str) -> Iterator[DeviceSyncs]:
    """Count the calls that make the host wait for ``device`` while the body runs.

    Args:
        device: The device the step runs on: the test accelerator, CUDA, or another
            accelerator (there only the wrapped ``torch.accelerator`` calls are seen).

    Yields:
        A :class:`DeviceSyncs`, filled when the body ends.
    """
    device = torch.device(device)
    spy = DeviceSyncs()
    before = _test_device_counts(device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_wrapped(torch.accelerator, "empty_host_cache", spy))
        if before is None:  # the test accelerator counts its own synchronizes
            stack.enter_context(_wrapped(torch.accelerator, "synchronize", spy))
        if device.type == "cuda":
            stack.enter_context(_cuda_sync_warnings(spy))
        yield spy
    after = _test_device_counts(device)
    if before is not None:
        for kind in _DEVICE_COUNTERS:
            spy.add(kind, after[kind] - before[kind])


@contextlib.contextmanager
def no_device_sync(device: torch.device | str, where: str = "the step") -> Iterator[DeviceSyncs]:
    """:func:`count_device_syncs`, raising ``AssertionError`` if the body waited for the device.

    Args:
        device: As in :func:`count_device_syncs`.
        where: Names the body in the error. Default: ``"the step"``.
    """
    with count_device_syncs(device) as spy:
        yield spy
    if spy.count:
        raise AssertionError(
            f"swap_pass.testing.no_device_sync: {where} made the host wait for {device} "
            f"{spy.count} time(s) ({spy.calls}). Nothing inside a step's forward or backward may "
            "synchronize the device: each such call stalls the copies swap_pass overlaps.")
