"""Test helpers: a model of an asynchronous device on CPU, which makes stream races fail tests.

On CPU every copy is synchronous, so a missing or misplaced stream wait cannot show up: the data
is always there when its reader runs. While :func:`stream_model` is active, ``device_streams``
of a CPU device behaves like an accelerator's instead:

* the device-to-host and host-to-device side streams are fake streams; a copy issued on one
  (:meth:`DeviceStreams.copy`) is queued, and its destination is filled with poison (NaN for
  floating dtypes: every ``0xFF`` byte pattern is one; ``0xFF`` bytes otherwise) until it runs;
* a queued copy runs when a consumer waits for it: ``wait`` / ``Stream.wait_event`` on an event
  recorded after it, ``Event.synchronize``, ``Stream.synchronize``, :meth:`StreamModel.synchronize`,
  or earlier, at points drawn from a seeded random generator (a real device may finish any copy
  at any time);
* the compute stream is the host: work on it runs at once, so an event recorded on it is
  complete, and a wait on it completes the copies it waits for;
* a host buffer given back to the pool is poisoned once its last queued copy ran, and a device
  storage freed by a swap is poisoned before it is freed.

A reader scheduled before its copy completes therefore reads poison and an exactness test
fails, the same way for a given seed. A queued copy whose source or destination storage was
freed before it ran is not performed; it is recorded in :attr:`StreamModel.hazards` (on a device
it would read or write memory the allocator may have handed out again).

Example::

    from swap_pass.testing import stream_model

    with stream_model(seed=0) as model:
        loss = model_under_test(batch); loss.backward()   # exactness checks as usual
    assert not model.hazards

The test suite runs entirely under the model with ``SWAP_PASS_STREAM_MODEL=1`` (or pytest's
``--stream-model``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator

import torch

from swap_pass.runtime import device as _device
from swap_pass.runtime.host_pool import host_pool

__all__ = ["ModelEvent", "ModelStream", "StreamModel", "poison_", "stream_model"]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with poison in place: NaN for floating and complex dtypes, all-ones bytes otherwise."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype == torch.uint8:
            t.fill_(0xFF)
        else:  # signed integers: -1 is all-ones bytes; other unsigned types are rare here
            t.fill_(-1 if t.dtype.is_signed else 0)
    return t


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the bytes ``storage`` has now (freeing it later is detected)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _fits(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds every element ``t`` addresses (it may have been freed)."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


@dataclasses.dataclass
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    then: list[Callable[[], None]] = dataclasses.field(default_factory=list)


class ModelStream:
    """A fake stream of the model. Side streams queue their copies; the compute stream does not.

    Args:
        model: The owning :class:`StreamModel`.
        name: Shown in ``repr`` and in hazards.
        is_compute: True for the stream that stands for the host's own (synchronous) work.
    """

    def __init__(self, model: StreamModel, name: str, is_compute: bool = False) -> None:
        self.model = model
        self.name = name
        self.is_compute = is_compute
        self.queue: deque[_Copy] = deque()
        self.issued = 0  # copies ever queued
        self.done = 0  # copies ever completed

    def __repr__(self) -> str:
        return f"ModelStream({self.name!r}, pending={len(self.queue)})"

    def wait_event(self, event: ModelEvent) -> None:
        """Order later work of this stream after ``event`` (here: complete it now)."""
        event.synchronize()

    def synchronize(self) -> None:
        """Complete every copy queued on this stream."""
        with self.model.lock:
            self.model.run_until(self, self.issued)

    def query(self) -> bool:
        return not self.queue


class ModelEvent:
    """A fake event: the position of its stream's queue when it was recorded."""

    def __init__(self, stream: ModelStream) -> None:
        self.stream = stream
        self.position = stream.issued

    def __repr__(self) -> str:
        return f"ModelEvent({self.stream.name!r}, position={self.position})"

    def query(self) -> bool:
        return self.stream.done >= self.position

    def synchronize(self) -> None:
        """Complete the copies queued on the event's stream before it was recorded."""
        with self.stream.model.lock:
            self.stream.model.run_until(self.stream, self.position)

    def record(self, stream: ModelStream | None = None) -> None:
        self.stream = stream or self.stream
        self.position = self.stream.issued


class _ModelStreams(_device.DeviceStreams):
    """``DeviceStreams`` of a CPU device under the model: side streams that queue."""

    def __init__(self, model: StreamModel, device: torch.device, use_streams: bool) -> None:
        super().__init__(device, use_streams=False)
        self.model = model
        self.is_async = True
        self.use_streams = use_streams
        self.pin_memory = False  # CPU builds cannot pin; the model does not need it

    def compute_stream(self) -> ModelStream:
        return self.model.compute

    def d2h_stream(self) -> ModelStream:
        return self.model.d2h if self.use_streams else self.model.compute

    def h2d_stream(self) -> ModelStream:
        return self.model.h2d if self.use_streams else self.model.compute

    def record_event(self, stream: ModelStream | None) -> ModelEvent:
        self.model.maybe_progress()
        return ModelEvent(stream or self.model.compute)

    @staticmethod
    def wait(stream, event) -> None:
        if stream is None or event is None:
            return
        stream.wait_event(event)

    def use(self, stream):
        return contextlib.nullcontext()

    def copy(self, stream, dst, src) -> None:
        if isinstance(dst, torch.UntypedStorage):  # two storages: every byte
            dst, src = _byte_view(dst), _byte_view(src)
        self.model.enqueue(stream or self.model.compute, dst, src)

    def free_storage(self, storage: torch.UntypedStorage) -> None:
        poison_(_byte_view(storage))
        storage.resize_(0)


class StreamModel:
    """The state of one :func:`stream_model` activation. See the module docstring.

    Attributes:
        compute, d2h, h2d: The fake compute and side streams.
        hazards: Descriptions of queued copies that found a storage freed when they ran.
        copies_queued: Copies issued on a side stream (the rest ran at once).
        copies_run_early: Queued copies completed at a random point, before anyone waited.
    """

    def __init__(self, seed: int = 0, early_probability: float = 0.25) -> None:
        self.rng = random.Random(seed)
        self.early_probability = early_probability
        self.lock = threading.RLock()
        self.compute = ModelStream(self, "compute", is_compute=True)
        self.d2h = ModelStream(self, "d2h")
        self.h2d = ModelStream(self, "h2d")
        self.hazards: list[str] = []
        self.copies_queued = 0
        self.copies_run_early = 0
        self._streams: dict[bool, _ModelStreams] = {}
        self._others: list[ModelStream] = []

    def new_stream(self, name: str | None = None) -> ModelStream:
        """Another side stream (e.g. to issue copies the way a second thread or device would)."""
        with self.lock:
            stream = ModelStream(self, name or f"side{len(self._others)}")
            self._others.append(stream)
            return stream

    def streams(self, device: torch.device, use_streams: bool) -> _ModelStreams:
        """The modelled ``DeviceStreams`` of a CPU device."""
        with self.lock:
            if use_streams not in self._streams:
                self._streams[use_streams] = _ModelStreams(self, device, use_streams)
            return self._streams[use_streams]

    def pending(self) -> int:
        """Copies queued and not yet run, on every stream this model made."""
        return sum(len(s.queue) for s in self._side_streams())

    # --- queueing and running ---------------------------------------------------------------

    def enqueue(self, stream: ModelStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (run it at once on the compute stream)."""
        with self.lock:
            if stream.is_compute:
                self._run(_Copy(dst, src), stream)
                return
            poison_(dst)
            stream.queue.append(_Copy(dst, src))
            stream.issued += 1
            self.copies_queued += 1
        self.maybe_progress()

    def run_until(self, stream: ModelStream, position: int) -> None:
        """Run ``stream``'s queued copies until ``position`` of them have completed."""
        while stream.done < position and stream.queue:
            self._run(stream.queue.popleft(), stream)
            stream.done += 1

    def synchronize(self) -> None:
        """Complete every queued copy (a device synchronize)."""
        with self.lock:
            for s in self._side_streams():
                self.run_until(s, s.issued)

    def maybe_progress(self) -> None:
        """At a seeded random point, let the device finish the oldest copy of one stream."""
        with self.lock:
            busy = [s for s in self._side_streams() if s.queue]
            if busy and self.rng.random() < self.early_probability:
                stream = self.rng.choice(busy)
                self.copies_run_early += 1
                self.run_until(stream, stream.done + 1)

    def host_buffer_released(self, buf: torch.Tensor) -> None:
        """Poison ``buf`` once the last queued copy that touches it has run."""
        with self.lock:
            last = self._last_copy_touching(buf)
            if last is None:
                poison_(buf)
            else:
                last.then.append(lambda: poison_(buf))

    # --- internals --------------------------------------------------------------------------

    def _side_streams(self) -> list[ModelStream]:
        return [self.d2h, self.h2d, *self._others]

    def _last_copy_touching(self, buf: torch.Tensor) -> _Copy | None:
        key = buf.untyped_storage()._cdata
        for s in self._side_streams():
            for c in reversed(s.queue):
                if key in (c.dst.untyped_storage()._cdata, c.src.untyped_storage()._cdata):
                    return c
        return None

    def _run(self, c: _Copy, stream: ModelStream) -> None:
        bad = [n for n, t in (("source", c.src), ("destination", c.dst)) if not _fits(t)]
        if bad:
            self.hazards.append(
                f"a copy on the {stream.name} stream ran after its {' and '.join(bad)} storage "
                f"was freed (shape {tuple(c.dst.shape)}, {c.dst.dtype})")
        else:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                c.dst.copy_(c.src)
        for fn in c.then:
            fn()


_active_lock = threading.Lock()


@contextlib.contextmanager
def stream_model(seed: int = 0, early_probability: float = 0.25) -> Iterator[StreamModel]:
    """Make CPU ``device_streams`` behave like an asynchronous device while active.

    Args:
        seed: Seeds the points at which queued copies complete early. Default: ``0``.
        early_probability: Chance, at each queue, record or wait, that the device finishes the
            oldest copy of one stream. ``0`` runs copies only when waited for. Default: ``0.25``.

    Yields:
        The :class:`StreamModel`; its ``hazards`` list what went wrong beyond poisoned reads.

    On exit every queued copy is completed. Models do not nest.
    """
    if not 0.0 <= early_probability <= 1.0:
        raise ValueError(f"swap_pass.stream_model: early_probability={early_probability} is "
                         "invalid. It must be in [0, 1].")
    with _active_lock:
        if _device._cpu_model is not None:
            raise RuntimeError("swap_pass.stream_model: a stream model is already active. "
                               "Models do not nest; exit the first one before starting another.")
        model = StreamModel(seed, early_probability)
        _device._cpu_model = model
        host_pool().on_release = model.host_buffer_released
    try:
        yield model
    finally:
        model.synchronize()
        with _active_lock:
            _device._cpu_model = None
            host_pool().on_release = None
