"""Device layer: which accelerator is present, its side streams and events, and a CPU fallback.

Copy pattern (events order the streams; a storage is freed once compute waited on its copy)::

    compute:  ... produce x ... record(e_ready)            wait(e_d2h) free(x)
    d2h:                         wait(e_ready) copy x->host record(e_d2h)

Everything is device-generic (``torch.Stream``, ``torch.Event``, ``torch.get_device_module``).
On CPU there are no streams or events: copies run synchronously and waits are no-ops. Every side
stream copy goes through :meth:`DeviceStreams.copy` and every free through
:meth:`DeviceStreams.free_storage`: the one place a device-specific rule (torch_npu's formats,
the test accelerator's checks) or an injected failure (``swap_pass.testing``) meets them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable

import torch
from torch.autograd.profiler import record_function

from swap_pass.state import free_checks as _free_checks
from swap_pass.state import streams as _streams
from swap_pass.state import streams_lock as _streams_lock

__all__ = [
    "COPY_RANGE",
    "DeviceStreams",
    "accelerator_type",
    "cannot_free_reason",
    "copy_range_name",
    "device_streams",
    "entry_compute_stream",
    "is_async_device",
    "new_side_stream",
    "register_free_check",
]

_NPU_MODULE = "torch_npu"

# --- accelerator discovery --------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _try_import_npu() -> bool:
    """Import torch_npu if it is installed, so that ``torch.accelerator`` sees Ascend NPUs."""
    try:
        importlib.import_module(_NPU_MODULE)
    except Exception:  # torch_npu missing, or present without Ascend drivers
        return False
    return True


def accelerator_type() -> str:
    """Return the accelerator's device type (``"cuda"``, ``"npu"``, ``"xpu"``...) or ``"cpu"``."""
    _try_import_npu()
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return acc.type
    return "cpu"


def is_async_device(device: torch.device | str) -> bool:
    """True when ``device`` has streams and events, so copies can overlap compute."""
    dev = torch.device(device)
    return dev.type != "cpu" and dev.type != "meta" and torch.accelerator.is_available()


# --- storages a device cannot free in place ----------------------------------------------------

# Note: [Storages a device cannot free]
# A swap frees a storage with ``resize_(0)`` and refills it with ``resize_(n)``. Some storages
# refuse: torch_npu resizes only storages in a base format (ND, NCHW, NHWC, NCDHW) and raises
# "Try to resize a storage without base format" for private ones (NZ, 5HD), which ops may produce
# where internal formats are allowed. The check registered for the device type (kept in
# state.free_checks) finds such a storage when its group is made; it stays on the device
# (``skipped_bytes["non_resizable"]``) instead of failing the free mid-step.

# torch_npu's base formats (ACL format ids): the only ones its resize hook accepts.
_NPU_BASE_FORMATS = frozenset({0, 1, 2, 30})  # NCHW, NHWC, ND, NCDHW


def register_free_check(device_type: str,
                        check: Callable[[torch.Tensor], str | None] | None) -> None:
    """Register ``check(tensor) -> reason | None`` for ``device_type`` (``None`` removes it): a
    reason keeps the storage on the device (Note: [Storages a device cannot free])."""
    if check is None:
        _free_checks.pop(device_type, None)
    else:
        _free_checks[device_type] = check


def cannot_free_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s storage cannot be freed in place on its device, or None."""
    check = _free_checks.get(tensor.device.type)
    return None if check is None else check(tensor)


def _npu_private_format(tensor: torch.Tensor) -> str | None:
    """torch_npu: a storage in a private format (NZ, 5HD...) cannot be resized."""
    get_format = getattr(importlib.import_module(_NPU_MODULE), "get_npu_format", None)
    if get_format is None:  # an old torch_npu: its resize hook decides at the free
        return None
    fmt = int(get_format(tensor))
    if fmt in _NPU_BASE_FORMATS:
        return None
    return (f"its NPU storage is in private format {fmt}, which torch_npu cannot resize; "
            "keep internal formats off (torch.npu.config.allow_internal_format = False) to "
            "have it swapped")


register_free_check("npu", _npu_private_format)  # only NPU tensors reach it: torch_npu is in


# --- streams and events -----------------------------------------------------------------------


class _NoEvent:
    """Stand-in for ``torch.Event`` where the work it would mark has already completed."""

    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class DeviceStreams:
    """Side streams (one for device-to-host, one for host-to-device) of one device, made lazily.

    Args:
        device: The device the streams belong to.
        use_streams: When False, copies run on the compute stream. Default: ``True``.
    """

    def __init__(self, device: torch.device, use_streams: bool = True) -> None:
        self.device = device
        self.is_async = is_async_device(device)
        self.use_streams = use_streams and self.is_async
        self.pin_memory = self.is_async  # page-locked host buffers make the copies asynchronous
        self._d2h: torch.Stream | None = None
        self._h2d: torch.Stream | None = None

    def compute_stream(self) -> torch.Stream | None:
        """The current stream (the caller's compute stream), or None on CPU: read once, when a
        swap begins (Note: [The compute stream of a swap] in ``group.py``)."""
        if not self.is_async:
            return None
        return torch.accelerator.current_stream(self.device)

    def d2h_stream(self, compute: torch.Stream | None = None) -> torch.Stream | None:
        """Stream for device-to-host copies; when side streams are off, the swap's
        ``compute`` stream (default: the current stream)."""
        return self._side_stream("_d2h", compute)

    def h2d_stream(self, compute: torch.Stream | None = None) -> torch.Stream | None:
        """Stream for host-to-device copies; as :meth:`d2h_stream`."""
        return self._side_stream("_h2d", compute)

    def _side_stream(self, attr: str, compute: torch.Stream | None) -> torch.Stream | None:
        if not self.use_streams:
            return compute if compute is not None else self.compute_stream()
        stream = getattr(self, attr)
        if stream is None:
            stream = new_side_stream(self.device)
            setattr(self, attr, stream)
        return stream

    def record_event(self, stream: torch.Stream | None) -> torch.Event | _NoEvent:
        """Record an event on ``stream`` (a no-op event on CPU)."""
        if stream is None:
            return _NoEvent()
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: torch.Stream | None, event: torch.Event | _NoEvent | None) -> None:
        """Make ``stream`` wait for ``event`` without blocking the host."""
        if stream is None or event is None or isinstance(event, _NoEvent):
            return
        stream.wait_event(event)

    def use(self, stream: torch.Stream | None):
        """Context manager that makes ``stream`` current (nothing on CPU, nor when it already is:
        entering a stream's context twice is an error on some torch releases)."""
        if stream is None or torch.accelerator.current_stream(self.device) == stream:
            return contextlib.nullcontext()
        return stream  # torch.Stream is a context manager that makes itself current

    def is_capturing(self, stream: torch.Stream | None) -> bool:
        """Whether ``stream`` (a swap's compute stream) or the current stream is capturing a
        graph (CUDA graphs, torch_npu's NPU graphs): nothing that touches host buffers, waits on
        an event recorded outside the capture or frees device memory may be queued then. Asks
        both queries (Note: [Asking both capture queries]); None (CPU) never captures."""
        if stream is None:
            return False
        query = getattr(stream, "is_capturing", None)
        if query is not None:
            try:
                if query():
                    return True
            except (RuntimeError, NotImplementedError):  # a backend without the query
                pass
        query = getattr(getattr(torch, self.device.type, None), "is_current_stream_capturing",
                        None)
        return bool(query()) if query is not None else False

    # Note: [Asking both capture queries]
    # ``torch.Stream.is_capturing`` asks the device guard, whose default answer is False: where
    # the guard does not override it (torch_npu's NPUGuardImpl, the test accelerator) it says
    # False mid-capture, and only the device module's ``is_current_stream_capturing``
    # (``torch.cuda``, ``torch.xpu``, torch_npu's ``torch.npu``) knows. Either True means capturing.

    def copy(self, stream: torch.Stream | None, dst: torch.Tensor | torch.UntypedStorage,
             src: torch.Tensor | torch.UntypedStorage, pinned: bool = False) -> None:
        """Copy ``src`` into ``dst`` on ``stream``, without blocking the host when the host side
        is ``pinned`` on an accelerator; a pageable host side copies with ``non_blocking=False``
        (not every backend guarantees an asynchronous copy from or to pageable memory).

        Tensors of one shape and dtype, or two storages of one size. The caller orders ``stream``
        after the producer of ``src`` (and the allocation of ``dst``) and records an event after
        it for the consumer. While ``torch.profiler`` records, the copy runs in a range named
        :func:`copy_range_name` (``swap-pass bench`` reads CPU copy bandwidth from it).
        """
        in_range = _enter_copy_range(dst) if _profiler_flag._is_profiler_enabled else None
        try:
            if stream is None:  # CPU: synchronous, no stream to make current
                dst.copy_(src)
            else:
                with stream:
                    dst.copy_(src, non_blocking=pinned and self.is_async)
        finally:
            if in_range is not None:
                in_range.__exit__(None, None, None)

    @staticmethod
    def keep_for_copy(tensor: torch.Tensor, stream: torch.Stream | None) -> None:
        """``record_stream``: keep ``tensor``'s storage out of its pool until ``stream`` ran the
        copy queued there (Note: [Frees on the allocating stream]); nothing on CPU."""
        if stream is not None and tensor.device.type != "cpu":
            tensor.record_stream(stream)

    @staticmethod
    def free_storage(storage: torch.UntypedStorage) -> None:
        """Free a swapped-out storage in place (its tensors keep their metadata). The block goes
        back to its allocating stream's pool, whatever stream is current; the swap's compute
        stream already waited for the copy out, whose stream was recorded on the storage (Note:
        [Frees on the allocating stream])."""
        storage.resize_(0)

    def allocate_storage(self, storage: torch.UntypedStorage, nbytes: int,
                         stream: torch.Stream | None) -> None:
        """Give a freed storage its ``nbytes`` back, allocated on ``stream`` (the compute stream
        of the swap: the stream of the storage's readers)."""
        with self.use(stream):
            storage.resize_(nbytes)


# Note: [Frees on the allocating stream]
# A freed block returns to the pool of the stream that allocated it, whose next allocation may
# take it at once. The free comes after the swap's compute stream waited on the copy's event,
# which covers every storage allocated there. A storage produced under another stream's context
# (``with torch.Stream(...)``: MoE, overlapped communication, FSDP2) returns to that stream's
# pool, which no event of ours orders: its next allocation can overwrite the block while the side
# stream's copy still reads it. PyTorch does not say which stream allocated a storage, so every
# storage a copy out reads gets ``record_stream(copy stream)`` when the copy is queued, on devices
# with streams (CUDA, torch_npu, the test accelerator); the allocator then keeps the block until
# that stream ran what it had queued at the free.
#
# The cost (why PyTorch's activation-offloading pass avoids record_stream): a block is reusable only
# once the copy stream is past the work queued at the free. The free already follows the compute
# stream's wait for this copy, so the extra wait is for later copies out (the next layers'), but a
# block freed on the compute stream, reusable at once in stream order, waits for them too: the
# allocator may reserve a block more. On the test accelerator (8 layers of 4 MiB inputs, freed one
# layer later, 5 steps; docs/results.md): 40 to 44 MiB reserved against 36 MiB without it for inputs
# from the compute stream (one or two blocks more, steady after a step or two); 48 MiB either way
# for inputs from another stream, where without it 9 frees per step raced their copy. A bounded
# extra block or two is the price of never handing out a block a copy still reads.


def new_side_stream(device: torch.device) -> torch.Stream:
    """A new stream on ``device`` for the side-stream copies.

    ``torch.Stream(device=...)``, else the device module's ``Stream`` (``torch.npu.Stream``:
    older torch_npu releases lack the device guard's ``getNewStream``).

    Raises:
        RuntimeError: Neither can make a stream; names the way out (a torch_npu paired with
            this torch, or ``SwapConfig(use_streams=False)``).
    """
    try:
        return torch.Stream(device=device)
    except (RuntimeError, NotImplementedError) as exc:
        generic = exc
    make = getattr(getattr(torch, device.type, None), "Stream", None)
    if make is not None:
        try:
            return make(device=device)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            generic = exc
    raise RuntimeError(
        f"swap_pass: cannot create a side stream on {device}: torch.Stream(device=...) raised "
        f"({generic}) and torch.{device.type}.Stream "
        f"{'does not exist' if make is None else 'failed too'}. Older torch_npu releases lack "
        "the device guard's getNewStream: install the torch_npu release paired with this torch, "
        "or set SwapConfig(use_streams=False) to copy on the compute stream (no overlap)."
    ) from generic


class _CppProfilerState:
    """Stand-in for the flag below where a torch build lacks it: asks the C++ state."""

    @property
    def _is_profiler_enabled(self) -> bool:
        return torch._C._autograd._profiler_enabled()


# torch.autograd.profiler's Python flag "for fast python checks" (set by torch.profiler.profile
# and torch.autograd.profiler.profile): an attribute read per copy, not a pybind call.
_profiler_flag = (torch.autograd.profiler
                  if hasattr(torch.autograd.profiler, "_is_profiler_enabled")
                  else _CppProfilerState())
COPY_RANGE = "swap_pass::copy"


def _enter_copy_range(dst: torch.Tensor | torch.UntypedStorage) -> record_function:
    """Enter the profiler range of a copy into ``dst`` (the caller exits it)."""
    nbytes = dst.nbytes if isinstance(dst, torch.Tensor) else dst.nbytes()
    in_range = record_function(copy_range_name(nbytes))
    in_range.__enter__()
    return in_range


def copy_range_name(nbytes: int) -> str:
    """The profiler range of one runtime copy of ``nbytes`` bytes: ``swap_pass::copy[N B]``."""
    return f"{COPY_RANGE}[{nbytes} B]"


def entry_compute_stream(t: torch.Tensor) -> torch.Stream | None:
    """The current stream on ``t``'s device (None if copies are synchronous): at a layer's entry,
    the compute stream of ``t``'s swap (Note: [The compute stream of a swap] in ``group.py``)."""
    ds = device_streams(t.device)
    return ds.compute_stream() if ds.is_async else None


def device_streams(device: torch.device | str, use_streams: bool = True) -> DeviceStreams:
    """Return the (cached) :class:`DeviceStreams` of ``device``."""
    # Fast path for every group: keys are complete devices (an index-less device or a string
    # misses), and a dict read is atomic; only a key's first call takes the lock.
    cached = _streams.get((device, use_streams))
    if cached is not None:
        return cached
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, torch.accelerator.current_device_index())
    key = (dev, use_streams)
    with _streams_lock:
        if key not in _streams:
            _streams[key] = DeviceStreams(dev, use_streams)
        return _streams[key]
