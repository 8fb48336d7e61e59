"""Failure injection: make the runtime's Nth free, copy, re-allocation or host buffer fail.

A failure part-way through a transition must leave every tensor its data (the all-or-nothing
rule); :func:`inject_failures` is how the tests reach each such point.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from swap_pass.runtime.device import DeviceStreams
from swap_pass.runtime.host_pool import HostBufferPool

__all__ = ["FailureInjector", "InjectedFailure", "inject_failures"]

class InjectedFailure(RuntimeError):
    """The error :func:`inject_failures` raises in place of a runtime operation."""


# What each kind of failure replaces: (class, method) pairs.
_INJECTION_POINTS: dict[str, tuple[tuple[type, str], ...]] = {
    "free": ((DeviceStreams, "free_storage"),),
    "copy": ((DeviceStreams, "copy"),),
    "allocate": ((DeviceStreams, "allocate_storage"),),
    "host_alloc": ((HostBufferPool, "take"),),
}


@dataclasses.dataclass
class FailureInjector:
    """What :func:`inject_failures` saw: calls per kind, and the failures it raised.

    Attributes:
        calls: Per kind (``"free"``, ``"copy"``, ``"allocate"``, ``"host_alloc"``), how many
            times the runtime called it while the injector was active.
        fired: The kinds whose failure was raised.
    """

    fail_at: dict[str, int]
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    fired: list[str] = dataclasses.field(default_factory=list)

    def before(self, kind: str) -> None:
        """Count a call of ``kind``; raise on the one asked to fail."""
        n = self.calls[kind] = self.calls.get(kind, 0) + 1
        if self.fail_at.get(kind) == n:
            self.fired.append(kind)
            raise InjectedFailure(f"swap_pass.testing.inject_failures: {kind} call #{n} failed "
                                  "(injected).")


def _wrap(injector: FailureInjector, kind: str, original):
    """``original`` (a function, or a staticmethod) with ``injector`` asked before each call."""
    is_static = isinstance(original, staticmethod)
    fn = original.__func__ if is_static else original

    def wrapper(*args, **kwargs):
        injector.before(kind)
        return fn(*args, **kwargs)

    return staticmethod(wrapper) if is_static else wrapper


@contextlib.contextmanager
def inject_failures(*, free: int | None = None, copy: int | None = None,
                    allocate: int | None = None,
                    host_alloc: int | None = None) -> Iterator[FailureInjector]:
    """Make the runtime's Nth storage free, copy, storage re-allocation or host buffer request
    raise :class:`InjectedFailure`, to test that a failure part-way leaves every tensor its data.

    Counts start at 1 when the block is entered and cover every device. A kind left ``None``
    never fails; its calls are still counted.

    Args:
        free: Fail the Nth ``resize_(0)`` of a swapped storage (a device that cannot resize it).
            Default: ``None``.
        copy: Fail the Nth copy between device and host. Default: ``None``.
        allocate: Fail the Nth re-allocation of a freed storage for its copy back (device memory
            exhausted). Default: ``None``.
        host_alloc: Fail the Nth request for a host buffer (pinned memory exhausted).
            Default: ``None``.

    Yields:
        The :class:`FailureInjector`, with its counts.

    Example::

        with inject_failures(free=2) as injected:
            group.wait_d2h()            # raises InjectedFailure; group back in "device"
        assert injected.fired == ["free"]
    """
    fail_at = {k: v for k, v in (("free", free), ("copy", copy), ("allocate", allocate),
                                 ("host_alloc", host_alloc)) if v is not None}
    for kind, n in fail_at.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"swap_pass.testing.inject_failures: {kind}={n!r} is invalid. It "
                             "must be a call number, 1 or more.")
    injector = FailureInjector(fail_at)
    saved = []
    for kind, points in _INJECTION_POINTS.items():
        for cls, name in points:
            original = cls.__dict__[name]
            saved.append((cls, name, original))
            setattr(cls, name, _wrap(injector, kind, original))
    try:
        yield injector
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)
