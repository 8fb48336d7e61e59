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
it would read or write memory the allocator may have handed out again), unless the storage died
and its allocating stream was ordered after the copy before anything could reuse it (Note:
[Storages that die with a copy queued]). The queue holds no strong reference to what a copy
reads or writes: a tensor that dies while its copy is queued dies, as it would on a device.

Note: [Happens-before checker]
Poison shows a consumer that reads too early, in the order the model happened to run things. The
checker shows every ordering a device may choose: each fake stream keeps a vector clock (one
counter per stream of the model), a side-stream copy ticks its stream's own counter, an event
carries a copy of its stream's clock, a stream that waits on an event takes the maximum of both,
and a host synchronize (``Event.synchronize``, ``Stream.synchronize``) merges the event's clock
into every stream. Access A happens before access B when B's stream clock has reached A's
counter. The checker records a race, naming both accesses, when

* a side-stream copy reads or writes a storage that a copy on another stream wrote (or reads a
  storage another copy writes) and the two are not ordered (host buffer reuse across streams
  and devices included: the pool's buffers are storages like any other);
* a side-stream copy is not ordered after the work its thread queued on its device's current
  compute stream before it: the producer of what it reads, and the allocation of what it writes
  (the copy's stream must have waited on an event of that compute stream recorded since the
  calling thread's last action there the model saw: a record, a wait, a free, or an event
  recorded on a side stream, after which compute work may follow; Note: [Producer waits per
  thread]). This is stricter than a per-storage stamp of the last compute write and needs no
  dispatch hook;
* a storage is freed (``DeviceStreams.free_storage``, i.e. ``resize_(0)``) or dies (its last
  tensor dropped) while a copy that touched it is not ordered before its allocating stream:
  the caching allocator hands a freed block to the next allocation on that stream at once. The
  allocating stream is the compute stream that was current where the storage first met the
  model. A death is judged once its finalizers ran (Note: [Storages that die with a copy
  queued]).

Note: [Producer waits per thread]
A device's current stream is per thread, and its default stream is one stream for all threads:
two threads that each drive their own model both queue work on it. What a thread's copy reads
was produced by that thread's work, so the producer wait asks for an event recorded after the
calling thread's last action on its current compute stream (:attr:`ModelStream.marks`), not
after any thread's: another thread's record or free in between says nothing about this thread's
data. The clocks stay per stream: a wait of the shared stream orders every thread's later work
on it, as on a device. A thread's first action marks nothing before it; until then its copies
must be ordered after all work queued so far.

Note: [Storages that die with a copy queued]
A storage whose last tensor dies goes back to its allocating stream's pool, and on a device its
bytes stay as they were until that stream's next allocation takes the block. A copy still queued
on it is therefore harmless when the allocating stream waits on that copy before queueing any
more work: in practice, from a finalizer of the dying storage (the graph path's ``swap_out`` and
``prefetch`` register one), which runs before control returns to code that could queue work. The
model registers its own finalizer when it first meets a storage, and CPython runs a dying
object's weakref callbacks newest first, so the model judges the death after every finalizer
registered later (the library's): any queued copy of the storage must then be ordered before
the allocating stream, or it is a race. A wait issued after the death returned is too late. On
CPU the bytes are gone at the death, so a copy that runs inside the death (the finalizer's wait
completes it) is not performed: it counts in :attr:`StreamModel.copies_on_dead_blocks` when the
allocating stream was ordered after it by the end of the death (a destination it should have
filled keeps its poison), and is a hazard otherwise. A finalizer registered before the model met
the storage runs after the model's judgement; its wait would not count. A host pool buffer that
dies with a copy queued is neither a race nor a hazard (the caching host allocator hands a pinned
block out again only after the copies that used it completed); that copy is not performed and
counts in ``copies_on_dead_blocks`` too.

Note: [The current stream in the model]
As on a device, the current stream is per thread and follows stream contexts: while the runtime
issues a copy (its ``with side_stream:`` on a device), the side stream is current, and code that
runs there, such as a finalizer called by the cyclic garbage collector
(:meth:`StreamModel.during_next_copy` runs one there), sees the side stream when it asks for
the current one. A storage's allocating stream is the stream current where the runtime gave it
its bytes (``DeviceStreams.allocate_storage``), or else the compute stream current where the
model first met it. A side stream that waits on an event does not complete the event's copies:
its later copies run after them, but a reader on the compute stream still finds the data missing
until the compute stream (the host) waits itself.

Several fake devices (:meth:`StreamModel.device`), each with a compute stream and two side
streams, share the one host pool, as several accelerators of one process do. The compute stream
may be replaced, per thread, by another of the model's streams (:meth:`StreamModel.use_stream`),
as under ``with torch.cuda.stream(s)``. :attr:`StreamModel.races` lists the races; leaving
``stream_model(check=True)`` with any raises :class:`StreamRaceError`.

Example::

    from swap_pass.testing import stream_model

    with stream_model(seed=0) as model:
        loss = model_under_test(batch); loss.backward()   # exactness checks as usual
    assert not model.hazards   # a race would have raised on leaving the block

The test suite runs entirely under the model with ``SWAP_PASS_STREAM_MODEL=1`` (or pytest's
``--stream-model``).

Test accelerator: :func:`load_test_accelerator` builds (once, cached under
``~/.cache/swap_pass/``; a C++ compiler and ``ninja`` are needed) and registers ``swaptest``, a
CPU-backed PrivateUse1 device whose side-stream copies really run later on worker threads, with a
caching allocator that hands a freed block back to its stream at once, poisoned, a resize hook
with failure injection and pinned host memory. Run your own training loop on it to see a missing
stream wait as wrong numbers::

    from swap_pass.testing import load_test_accelerator

    device = load_test_accelerator()   # "swaptest"; torch.accelerator now reports it
    model = MyModel().to(device)
    loss = model(batch.to(device)).sum(); loss.backward()   # compare with a run without swap

Its knobs (copy delay and seed, resize failures, allocator and pinned statistics) live in
``swap_pass._test_accelerator``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator

import torch

from swap_pass._test_accelerator import load_test_accelerator
from swap_pass.device_syncs import DeviceSyncs, count_device_syncs, no_device_sync
from swap_pass.runtime import device as _device
from swap_pass.runtime.host_pool import host_pool

__all__ = [
    "DeviceSyncs",
    "FailureInjector",
    "InjectedFailure",
    "ModelEvent",
    "ModelStream",
    "StreamModel",
    "StreamRaceError",
    "count_device_syncs",
    "inject_failures",
    "load_test_accelerator",
    "no_device_sync",
    "poison_",
    "stream_model",
]


class StreamRaceError(AssertionError):
    """Accesses of two streams (or a copy and a free) that no wait orders, found by the checker."""


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with poison in place: NaN for floating and complex dtypes, all-ones bytes
    otherwise."""
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


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side of a queued copy, held weakly: the storage, and where the tensor lies in it."""

    storage: weakref.ref
    key: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Side:
        s = t.untyped_storage()
        return cls(weakref.ref(s), s._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                   t.dtype)

    def tensor(self) -> torch.Tensor | None:
        """The tensor again, or None when its storage died or no longer holds every element."""
        storage = self.storage()
        if storage is None:
            return None
        if all(self.size):  # not empty: every element must still be there
            last = self.offset + sum((n - 1) * s
                                     for n, s in zip(self.size, self.stride, strict=True))
            if storage.nbytes() < (last + 1) * self.dtype.itemsize:
                return None
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.size, self.stride)


def _poison_side(side: _Side) -> None:
    t = side.tensor()
    if t is not None:
        poison_(t)


@dataclasses.dataclass
class _Copy:
    dst: _Side
    src: _Side
    what: str  # how races and hazards name it
    then: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    stream: ModelStream | None = None  # the side stream it was queued on, and its counter there
    counter: int = 0


@dataclasses.dataclass(frozen=True)
class _Wait:
    """A side stream's wait on another stream's event, queued among its copies."""

    stream: ModelStream
    position: int


@dataclasses.dataclass(frozen=True)
class _Access:
    stream: ModelStream
    clock: int
    write: bool
    what: str


class ModelStream:
    """A fake stream of the model. Side streams queue their copies; compute streams do not.

    Args:
        model: The owning :class:`StreamModel`.
        name: Shown in ``repr``, hazards and races.
        is_compute: True for a stream that stands for the host's own (synchronous) work.
        device: The fake device's index. Default: ``0``.
    """

    def __init__(self, model: StreamModel, name: str, is_compute: bool = False,
                 device: int = 0) -> None:
        self.model = model
        self.name = name
        self.is_compute = is_compute
        self.device = device
        self.index = len(model._all_streams)
        model._all_streams.append(self)
        self.clock: dict[int, int] = {self.index: 0}  # the vector clock
        # Compute streams: per thread, this stream's counter at that thread's last action (see
        # Note: [Producer waits per thread]).
        self.marks: dict[int, int] = {}
        self.queue: deque[_Copy | _Wait] = deque()
        self.issued = 0  # copies ever queued
        self.done = 0  # copies ever completed
        self.capturing = False  # set by a test: the stream reports a graph capture in progress

    def __repr__(self) -> str:
        return f"ModelStream({self.name!r}, pending={len(self.queue)})"

    @property
    def now(self) -> int:
        """This stream's own counter."""
        return self.clock[self.index]

    def tick(self) -> int:
        self.clock[self.index] += 1
        return self.clock[self.index]

    def act(self) -> None:
        """An action of the calling thread on this compute stream: tick, and mark it the
        thread's last (Note: [Producer waits per thread])."""
        self.marks[threading.get_ident()] = self.tick()

    def last_action(self) -> int:
        """The counter of the calling thread's last action here; before its first one, this
        stream's counter (all work queued so far may be the thread's producer)."""
        return self.marks.get(threading.get_ident(), self.now)

    def has_seen(self, other: ModelStream, counter: int) -> bool:
        """Whether this stream is ordered after ``other``'s work up to ``counter``."""
        return other is self or self.clock.get(other.index, 0) >= counter

    def merge(self, clock: dict[int, int]) -> None:
        for k, v in clock.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v

    def wait_event(self, event: ModelEvent) -> None:
        """Order later work of this stream after ``event``. A compute stream is the host: the
        event's copies complete now. A side stream only queues the wait: its later copies run
        after the event's (Note: [The current stream in the model])."""
        with self.model.lock:
            if self.is_compute:
                self.model.run_until(event.stream, event.position)
            elif event.stream is not self and event.stream.done < event.position:
                self.queue.append(_Wait(event.stream, event.position))
                self.issued += 1
            self.merge(event.clock)
            if self.is_compute:
                self.act()

    def synchronize(self) -> None:
        """Complete every copy queued on this stream (a host synchronize)."""
        with self.model.lock:
            self.model.run_until(self, self.issued)
            self.model.host_waited(self.clock)

    def query(self) -> bool:
        return not self.queue

    def is_capturing(self) -> bool:
        """Whether the stream reports a graph capture (a test sets :attr:`capturing`)."""
        return self.capturing

    def record(self) -> dict[int, int]:
        """The clock an event recorded now carries (a compute stream ticks first)."""
        if self.is_compute:
            self.act()
        else:
            self.model.side_event_recorded(self)
        return dict(self.clock)


class ModelEvent:
    """A fake event: the position of its stream's queue, and its clock, when it was recorded."""

    def __init__(self, stream: ModelStream) -> None:
        self.record(stream)

    def __repr__(self) -> str:
        return f"ModelEvent({self.stream.name!r}, position={self.position})"

    def query(self) -> bool:
        return self.stream.done >= self.position

    def synchronize(self) -> None:
        """Complete the copies queued on the event's stream before it was recorded (host wait)."""
        with self.stream.model.lock:
            self.stream.model.run_until(self.stream, self.position)
            self.stream.model.host_waited(self.clock)

    def record(self, stream: ModelStream | None = None) -> None:
        self.stream = stream or self.stream
        with self.stream.model.lock:
            self.position = self.stream.issued
            self.clock = self.stream.record()


class _FakeDevice:
    """One fake device of the model: a compute stream and two side streams."""

    def __init__(self, model: StreamModel, index: int) -> None:
        suffix = "" if index == 0 else f":{index}"
        self.index = index
        self.compute = ModelStream(model, "compute" + suffix, is_compute=True, device=index)
        self.d2h = ModelStream(model, "d2h" + suffix, device=index)
        self.h2d = ModelStream(model, "h2d" + suffix, device=index)
        self.streams: dict[bool, _ModelStreams] = {}


class _ModelStreams(_device.DeviceStreams):
    """``DeviceStreams`` of a CPU device under the model: side streams that queue."""

    def __init__(self, model: StreamModel, fake: _FakeDevice, device: torch.device,
                 use_streams: bool) -> None:
        super().__init__(device, use_streams=False)
        self.model = model
        self.fake = fake
        self.is_async = True
        self.use_streams = use_streams
        self.pin_memory = False  # CPU builds cannot pin; the model does not need it

    def compute_stream(self) -> ModelStream:
        # The stream current in this thread: inside a copy, its side stream (as under a
        # device's ``with stream:``); see Note: [The current stream in the model].
        return self.model.current_stream(self.fake.index)

    def d2h_stream(self, compute: ModelStream | None = None) -> ModelStream:
        if self.use_streams:
            return self.fake.d2h
        return compute if compute is not None else self.compute_stream()

    def h2d_stream(self, compute: ModelStream | None = None) -> ModelStream:
        if self.use_streams:
            return self.fake.h2d
        return compute if compute is not None else self.compute_stream()

    def record_event(self, stream: ModelStream | None) -> ModelEvent:
        self.model.maybe_progress()
        return ModelEvent(stream or self.compute_stream())

    @staticmethod
    def wait(stream, event) -> None:
        if stream is None or event is None:
            return
        stream.wait_event(event)

    def use(self, stream):
        if stream is None:
            return contextlib.nullcontext()
        return self.model.current(stream)

    def copy(self, stream, dst, src, pinned: bool = False, compute=None) -> None:
        if isinstance(dst, torch.UntypedStorage):  # two storages: every byte
            dst, src = _byte_view(dst), _byte_view(src)
        compute = compute or self.model.thread_compute(self.fake.index)
        stream = stream or compute
        with self.model.current(stream):  # as ``with stream:`` on a device
            self.model.enqueue(stream, dst, src, compute=compute)
            self.model.run_copy_hooks()

    def free_storage(self, storage: torch.UntypedStorage, compute=None) -> None:
        self.model.freed(storage, compute or self.compute_stream())
        poison_(_byte_view(storage))
        storage.resize_(0)

    def allocate_storage(self, storage: torch.UntypedStorage, nbytes: int, stream) -> None:
        with self.use(stream):
            storage.resize_(nbytes)
            self.model.allocated(storage, self.compute_stream())


class StreamModel:
    """The state of one :func:`stream_model` activation. See the module docstring.

    Attributes:
        compute, d2h, h2d: The fake compute and side streams of device 0.
        hazards: Descriptions of queued copies that found a storage freed when they ran.
        races: Descriptions of unordered accesses (see Note: [Happens-before checker]).
        copies_queued: Copies issued on a side stream (the rest ran at once).
        copies_run_early: Queued copies completed at a random point, before anyone waited.
        copies_on_dead_blocks: Queued copies not performed, and not hazards, because a storage
            of theirs died where a device would still hold its bytes: it was dying when they
            ran and its allocating stream was ordered after them by the end of that death, or
            it was a host pool buffer (see Note: [Storages that die with a copy queued]).
    """

    def __init__(self, seed: int = 0, early_probability: float = 0.25) -> None:
        self.rng = random.Random(seed)
        self.early_probability = early_probability
        self.lock = threading.RLock()
        self._all_streams: list[ModelStream] = []
        self._devices: list[_FakeDevice] = [_FakeDevice(self, 0)]
        self._others: list[ModelStream] = []
        self._local = threading.local()
        self._copy_hooks: list[Callable[[], object]] = []
        self.hazards: list[str] = []
        self.races: list[str] = []
        self.copies_queued = 0
        self.copies_run_early = 0
        self.copies_on_dead_blocks = 0
        self._copies = 0
        # Per storage key: the latest access of each (stream, write) pair; the allocating stream;
        # the finalizer that checks the storage's death.
        self._accesses: dict[int, dict[tuple[int, bool], _Access]] = {}
        self._owner: dict[int, ModelStream] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        # Storages of the host pool's buffers: their death is never a race (a pinned block is
        # reused only after the copies that used it completed; a pageable copy is synchronous).
        self._host_keys: set[int] = set()
        # Per storage key whose death is in progress: the queued copies that ran meanwhile.
        self._dying: dict[int, list[_Copy]] = {}

    # --- devices and streams ----------------------------------------------------------------

    @property
    def compute(self) -> ModelStream:
        return self._devices[0].compute

    @property
    def d2h(self) -> ModelStream:
        return self._devices[0].d2h

    @property
    def h2d(self) -> ModelStream:
        return self._devices[0].h2d

    def _fake(self, index: int) -> _FakeDevice:
        with self.lock:
            while len(self._devices) <= index:
                self._devices.append(_FakeDevice(self, len(self._devices)))
            return self._devices[index]

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """Make fake device ``index`` the current device of this thread (as ``torch.cuda.device``).

        Groups and graph ops started meanwhile use its streams; a group keeps the device it
        started on."""
        self._fake(index)
        previous = getattr(self._local, "device", 0)
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = previous

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def current_stream(self, device: int) -> ModelStream:
        """The stream current on fake device ``device`` in this thread: a side stream while one
        of its copies is issued (Note: [The current stream in the model]), else the compute
        stream."""
        side = getattr(self._local, "side", None)
        stream = side.get(device) if side else None
        return stream if stream is not None else self.thread_compute(device)

    def thread_compute(self, device: int) -> ModelStream:
        """The compute stream of fake device ``device`` in this thread (the default one, or the
        one :meth:`use_stream` made current)."""
        current = getattr(self._local, "streams", None)
        stream = current.get(device) if current else None
        return stream if stream is not None else self._fake(device).compute

    @contextlib.contextmanager
    def current(self, stream: ModelStream) -> Iterator[ModelStream]:
        """Make ``stream``, compute or side, current on its device in this thread (what a
        device's ``with stream:`` does)."""
        if stream.is_compute:
            with self.use_stream(stream), self._side(stream.device, None):
                yield stream
        else:
            with self._side(stream.device, stream):
                yield stream

    @contextlib.contextmanager
    def _side(self, device: int, stream: ModelStream | None) -> Iterator[None]:
        if not hasattr(self._local, "side"):
            self._local.side = {}
        previous = self._local.side.get(device)
        self._local.side[device] = stream
        try:
            yield
        finally:
            self._local.side[device] = previous

    def during_next_copy(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` once, inside the next copy issued through the model, while the copy's
        stream is current: where a device's cyclic garbage collection can run finalizers (Note:
        [The current stream in the model])."""
        self._copy_hooks.append(fn)

    def run_copy_hooks(self) -> None:
        hooks, self._copy_hooks = self._copy_hooks, []
        for fn in hooks:
            fn()

    @contextlib.contextmanager
    def use_stream(self, stream: ModelStream) -> Iterator[ModelStream]:
        """Make ``stream`` (one of :meth:`new_stream`'s with ``compute=True``) the current
        compute stream of its device in this thread, as ``with torch.cuda.stream(s)`` does."""
        if not stream.is_compute:
            raise ValueError(f"swap_pass.StreamModel.use_stream: {stream.name} is a side stream. "
                             "Only a compute stream (new_stream(compute=True)) can be current.")
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        previous = self._local.streams.get(stream.device)
        self._local.streams[stream.device] = stream
        try:
            yield stream
        finally:
            self._local.streams[stream.device] = previous

    def new_stream(self, name: str | None = None, *, device: int | None = None,
                   compute: bool = False) -> ModelStream:
        """Another stream: a side stream (copies queue), or with ``compute`` a second compute
        stream (work runs at once; make it current with :meth:`use_stream`). Default: on the
        current fake device."""
        with self.lock:
            stream = ModelStream(self, name or f"side{len(self._others)}", is_compute=compute,
                                 device=self.current_device() if device is None else device)
            self._others.append(stream)
            return stream

    def streams(self, device: torch.device, use_streams: bool) -> _ModelStreams:
        """The modelled ``DeviceStreams`` of a CPU device, on this thread's current fake device."""
        fake = self._fake(self.current_device())
        with self.lock:
            if use_streams not in fake.streams:
                fake.streams[use_streams] = _ModelStreams(self, fake, device, use_streams)
            return fake.streams[use_streams]

    def pending(self) -> int:
        """Copies queued and not yet run, on every stream this model made."""
        return sum(len(s.queue) for s in self._side_streams())

    # --- queueing and running ---------------------------------------------------------------

    def enqueue(self, stream: ModelStream, dst: torch.Tensor, src: torch.Tensor,
                compute: ModelStream | None = None) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (run it at once on a compute stream), issued by
        a thread computing on ``compute`` (default: its current compute stream)."""
        with self.lock:
            self._copies += 1
            what = (f"copy #{self._copies} on the {stream.name} stream ({tuple(src.shape)} "
                    f"{src.dtype} -> {tuple(dst.shape)} {dst.dtype})")
            c = _Copy(_Side.of(dst), _Side.of(src), what)
            self._check_copy(stream, c, compute or self.thread_compute(stream.device))
            if stream.is_compute:
                self._run(c, stream)
                return
            self._poison_when_unread(dst, c.dst)
            stream.queue.append(c)
            stream.issued += 1
            self.copies_queued += 1
        self.maybe_progress()

    def _poison_when_unread(self, dst: torch.Tensor, side: _Side) -> None:
        """Poison a queued copy's destination now, or, where a copy queued earlier on another
        stream still reads it (a host buffer the copy's stream waits to reuse), once that copy
        has run."""
        last = self._last_copy_touching(dst)
        if last is None:
            poison_(dst)
        else:
            last.then.append(lambda: _poison_side(side))

    def run_until(self, stream: ModelStream, position: int) -> None:
        """Run ``stream``'s queued copies until ``position`` of them have completed."""
        while stream.done < position and stream.queue:
            item = stream.queue.popleft()
            if isinstance(item, _Wait):
                self.run_until(item.stream, item.position)
            else:
                self._run(item, stream)
            stream.done += 1

    def synchronize(self) -> None:
        """Complete every queued copy (a device synchronize)."""
        with self.lock:
            for s in self._side_streams():
                self.run_until(s, s.issued)
            for s in self._all_streams:
                self.host_waited(s.clock)

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

    # --- the happens-before checker (Note: [Happens-before checker]) ------------------------

    def host_waited(self, clock: dict[int, int]) -> None:
        """The host waited for work up to ``clock``: every stream's later work is ordered after."""
        for s in self._all_streams:
            s.merge(clock)

    def side_event_recorded(self, stream: ModelStream) -> None:
        """A side stream's copies are done being issued: compute work may follow."""
        self.thread_compute(stream.device).act()

    def freed(self, storage: torch.UntypedStorage, by: ModelStream) -> None:
        """``storage`` is freed in place now, on the compute stream ``by``."""
        with self.lock:
            key = storage._cdata
            self._check_release(key, self._owner.get(key, by), "freed (resize_(0))")
            by.act()

    def _race(self, first: str, second: str, why: str) -> None:
        self.races.append(f"{second} is not ordered after {first}: {why}")

    def _check_copy(self, stream: ModelStream, c: _Copy, compute: ModelStream) -> None:
        last = compute.last_action()
        if not stream.is_compute and not stream.has_seen(compute, last):
            self._race(f"the work this thread queued on the {compute.name} stream before it "
                       f"(position {last}: the producer of its source, the allocation of its "
                       "destination)", c.what,
                       f"the last {compute.name} event the {stream.name} stream waited on is at "
                       f"{stream.clock.get(compute.index, 0)}; a producer wait is missing")
        counter = stream.tick() if not stream.is_compute else stream.now + 1
        c.stream, c.counter = stream, counter
        for side, write in ((c.src, False), (c.dst, True)):
            self._access(side, _Access(stream, counter, write,
                                       f"the {'write' if write else 'read'} of {c.what}"), compute)

    def _access(self, side: _Side, access: _Access, compute: ModelStream) -> None:
        key = side.key
        log = self._accesses.get(key)
        if log is None:
            log = self._accesses[key] = {}
            self._watch(key, side.storage(), compute)
        for prior in log.values():
            if prior.stream is not access.stream and (prior.write or access.write) \
                    and not access.stream.has_seen(prior.stream, prior.clock):
                self._race(prior.what, access.what,
                           f"the {access.stream.name} stream never waited on an event of the "
                           f"{prior.stream.name} stream recorded after it")
        log[(access.stream.index, access.write)] = access

    def _watch(self, key: int, storage: torch.UntypedStorage | None, owner: ModelStream) -> None:
        """Start watching a storage: its allocating stream (unless its allocation was seen) and
        a finalizer that judges its death."""
        self._owner.setdefault(key, owner)
        if storage is not None and key not in self._host_keys and key not in self._finalizers:
            self._finalizers[key] = weakref.finalize(storage, self._died, key)

    def allocated(self, storage: torch.UntypedStorage, stream: ModelStream) -> None:
        """``storage`` got its bytes (again) on ``stream``: its allocating stream from now on."""
        with self.lock:
            key = storage._cdata
            self._owner[key] = stream
            self._watch(key, storage, stream)

    def _check_release(self, key: int, owner: ModelStream, how: str) -> None:
        for prior in self._accesses.pop(key, {}).values():
            if prior.stream is not owner and not owner.has_seen(prior.stream, prior.clock):
                self._race(prior.what, f"the storage {how} for reuse on its allocating stream "
                           f"{owner.name}", f"{owner.name} never waited on an event of the "
                           f"{prior.stream.name} stream recorded after the copy")
        self._owner.pop(key, None)
        fin = self._finalizers.pop(key, None)
        if fin is not None:
            fin.detach()

    def _died(self, key: int) -> None:
        """The storage ``key`` died: its block goes back to its allocating stream's pool (Note:
        [Storages that die with a copy queued])."""
        with self.lock:
            self._finalizers.pop(key, None)
            owner = self._owner.get(key)
            if owner is not None:
                self._check_release(key, owner, "died (its last tensor dropped)")
            for c in self._dying.pop(key, ()):
                if owner is not None and owner.has_seen(c.stream, c.counter):
                    self.copies_on_dead_blocks += 1
                else:
                    self.hazards.append(f"{c.what} ran after a storage of it died, before its "
                                        "allocating stream waited for it")

    def host_buffer_allocated(self, buf: torch.Tensor) -> None:
        """The host pool made ``buf``: a host buffer, not device memory."""
        with self.lock:
            self._host_keys.add(buf.untyped_storage()._cdata)

    def close(self) -> None:
        """Stop watching storages (called on leaving :func:`stream_model`)."""
        with self.lock:
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
            self._accesses.clear()
            self._owner.clear()
            self._host_keys.clear()
            self._dying.clear()

    # --- internals --------------------------------------------------------------------------

    def _is_dying(self, side: _Side) -> bool:
        """Whether ``side``'s storage is dying now: its weak references are cleared, and the
        finalizers of that death (this model's is the last of them) are running."""
        fin = self._finalizers.get(side.key)
        return fin is not None and fin.alive and side.storage() is None

    def _is_dead_host_buffer(self, side: _Side) -> bool:
        """Whether ``side`` is a host pool buffer that died (as a pinned block on a device, it
        is handed out again only once the copies that used it completed)."""
        return side.key in self._host_keys and side.storage() is None

    def _side_streams(self) -> list[ModelStream]:
        return [s for s in self._all_streams if not s.is_compute]

    def _last_copy_touching(self, buf: torch.Tensor) -> _Copy | None:
        key = buf.untyped_storage()._cdata
        for s in self._side_streams():
            for c in reversed(s.queue):
                if isinstance(c, _Wait):
                    continue
                if key in (c.dst.key, c.src.key):
                    return c
        return None

    def _run(self, c: _Copy, stream: ModelStream) -> None:
        dst, src = c.dst.tensor(), c.src.tensor()
        if dst is not None and src is not None:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                dst.copy_(src)
        else:
            self._not_performed(c, [(n, side) for n, side, t in (("source", c.src, src),
                                                                 ("destination", c.dst, dst))
                                    if t is None])
        for fn in c.then:
            fn()

    def _not_performed(self, c: _Copy, gone: list[tuple[str, _Side]]) -> None:
        """``c`` cannot run: the storages ``gone`` (name, side) died or were freed in place. See
        Note: [Storages that die with a copy queued]."""
        freed = [n for n, side in gone
                 if not self._is_dying(side) and not self._is_dead_host_buffer(side)]
        if freed:
            self.hazards.append(f"{c.what} ran after its {' and '.join(freed)} storage was freed")
            return
        dying = [side.key for _, side in gone if self._is_dying(side)]
        for key in dying:  # judged when the death ends: see _died
            self._dying.setdefault(key, []).append(c)
        if not dying:  # host buffers only: a pinned block waits for the copies that used it
            self.copies_on_dead_blocks += 1


_active_lock = threading.Lock()


@contextlib.contextmanager
def stream_model(seed: int = 0, early_probability: float = 0.25,
                 check: bool = True) -> Iterator[StreamModel]:
    """Make CPU ``device_streams`` behave like an asynchronous device while active.

    Args:
        seed: Seeds the points at which queued copies complete early. Default: ``0``.
        early_probability: Chance, at each queue, record or wait, that the device finishes the
            oldest copy of one stream. ``0`` runs copies only when waited for. Default: ``0.25``.
        check: Raise :class:`StreamRaceError` on leaving when the happens-before checker found
            races (see Note: [Happens-before checker]); with False they are only listed in
            ``model.races``. Default: ``True``.

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
        host_pool().on_allocate = model.host_buffer_allocated
    ok = False
    try:
        yield model
        ok = True
    finally:
        model.synchronize()
        model.close()
        with _active_lock:
            _device._cpu_model = None
            host_pool().on_release = None
            host_pool().on_allocate = None
    if ok and check and model.races:
        raise StreamRaceError(f"swap_pass.stream_model: {len(model.races)} race(s) found:\n- "
                              + "\n- ".join(dict.fromkeys(model.races)))


# --- failure injection ----------------------------------------------------------------------


class InjectedFailure(RuntimeError):
    """The error :func:`inject_failures` raises in place of a runtime operation."""


# What each kind of failure replaces: (class, method) pairs; the stream model's device layer
# overrides the device methods, so both are patched.
_INJECTION_POINTS: dict[str, tuple[tuple[type, str], ...]] = {
    "free": ((_device.DeviceStreams, "free_storage"), (_ModelStreams, "free_storage")),
    "copy": ((_device.DeviceStreams, "copy"), (_ModelStreams, "copy")),
    "allocate": ((_device.DeviceStreams, "allocate_storage"), (_ModelStreams, "allocate_storage")),
    "host_alloc": ((type(host_pool()), "take"),),
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

    Counts start at 1 when the block is entered and cover every device (and the stream model's,
    when it is active). A kind left ``None`` never fails; its calls are still counted.

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
