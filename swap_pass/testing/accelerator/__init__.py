"""A CPU-backed asynchronous test accelerator, registered as PrivateUse1 under the name
``swaptest``.

:func:`load_test_accelerator` compiles the C++ sources in ``csrc/`` with
``torch.utils.cpp_extension.load`` (once per torch version and source hash; the build is cached
under ``~/.cache/swap_pass/test_accelerator/``, or ``$SWAP_PASS_TEST_ACCELERATOR_CACHE``), loads
them and registers the device. After it, ``torch.accelerator.is_available()`` is True and
``torch.accelerator.current_accelerator().type == "swaptest"``.

What the device models (2 devices, memory in host RAM):

* streams and events through the device guard: a default stream and a pool of 32 side streams per
  device (``torch.Stream(device=...)`` takes the next one, round robin), each a FIFO run by a
  worker thread of its own; events record, wait, query, synchronize and time;
* compute ops run through a CPU fallback on the calling thread, after the current stream's queue
  drained (so in stream order; compute itself is not asynchronous);
* ``torch.compile`` with Inductor generates its C++ (CPU) kernels for the device (:mod:`.inductor`):
  each kernel runs after a barrier that drains the current stream, checks its reads and notes its
  writes, as the fallback does for an eager op (:func:`inductor_reason` says why not, where this
  torch cannot);
* the order is checked where timing cannot show it (:func:`set_order_check`, on by default), as a
  happens-before checker: each stream and the host carry a vector clock (an event takes its
  stream's, a wait merges it into the waiting stream's, a host synchronize or a ``query()`` that
  answers True into the host's), and each byte range of a device block or a pinned host block
  the position of its last write (the allocation first: a write on the allocating stream) and
  the reads since. A read (a copy, a compute op's input, an Inductor kernel's, ``.item()``) not
  ordered after the last write of its bytes reads poison (``0xFF`` bytes), as a copy racing its
  producer may on a device, and is counted (``memory_stats()["unordered_reads"]``); a write not
  ordered after the last write and the reads since of its bytes is counted as
  ``unordered_writes`` (write after write, write after read: what timing shows only when the other
  access happens to run late); a block freed while a queued copy that used it is not ordered
  before its allocating stream is counted as ``unordered_frees``. The host's own reads and writes
  of pinned memory are not seen;
* copies between the host and the device (host to device, device to host, device to device) on a
  side stream, and non-blocking ones to or from pinned memory on the default stream, are queued
  on their stream and start after a seeded delay (200-400 ms by default), or as soon as the host
  waits for them (``Event.synchronize``, a stream synchronize, or a compute op on a stream that
  waits on them; a stream's ``wait_event`` alone does not start them). A reader that did not wait
  reads what was there before: poison, or stale data. Other copies on the default stream run at
  once. A copy across devices carries CUDA's two-way barrier (it waits for the destination
  device's current stream, which then waits for it);
* a caching allocator with per-stream pools: a freed block returns to its allocating stream's
  pool at once and is filled with ``0xFF`` bytes (NaN in every floating dtype) in that stream's
  order; the next allocation of a fitting size on that stream reuses it; ``record_stream`` keeps it
  out of the pool until the streams it names ran what they had queued; fresh blocks are poisoned
  too; ``untyped_storage().resize_()`` goes through the PrivateUse1 resize hook, with failure
  injection (:func:`fail_nth_resize`, :func:`mark_not_resizable`);
* a memory cap: each device reports 16 GiB (``torch.swaptest.get_device_properties().total_memory``,
  ``torch.swaptest.mem_get_info()``); ``torch.swaptest.set_per_process_memory_fraction`` caps the
  reserved bytes, past which an allocation frees the cached blocks, retries and raises
  ``torch.OutOfMemoryError``;
* pinned host memory (``pin_memory=True``, ``Tensor.pin_memory()``, ``is_pinned()``) from a caching
  host allocator that rounds each block up to a power of two, as CUDA's does; a block is not
  handed out again before the queued copies that use it ran, and is poisoned when it is.
  :func:`pinned_stats` reports the rounded bytes in use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pathlib
import shutil
import threading
import types

import torch

from swap_pass.runtime.device import register_free_check

__all__ = [
    "DEVICE_TYPE",
    "CopyWindow",
    "TestAcceleratorUnavailable",
    "delay_settings",
    "empty_cache",
    "fail_nth_resize",
    "inductor_reason",
    "compute_counts",
    "copy_windows",
    "load_test_accelerator",
    "mark_not_resizable",
    "memory_stats",
    "order_counters",
    "pinned_stats",
    "record_copy_windows",
    "resize_calls",
    "order_check",
    "set_delay",
    "set_order_check",
    "set_seed",
    "synchronize",
]

DEVICE_TYPE = "swaptest"
CACHE_ENV = "SWAP_PASS_TEST_ACCELERATOR_CACHE"
_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = ("runtime.cpp", "memory.cpp", "ops.cpp")

_lock = threading.Lock()
_ext: types.ModuleType | None = None


class TestAcceleratorUnavailable(RuntimeError):
    """The test accelerator cannot be built here (no C++ compiler, no ninja, a build error)."""

    __test__ = False  # not a pytest test class


# --- building ---------------------------------------------------------------------------------


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_directory() -> pathlib.Path:
    """Where the extension is built: one folder per torch version and source hash."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "swap_pass", "test_accelerator")
    tag = f"torch-{torch.__version__.replace('+', '_')}-{_source_hash()}"
    return pathlib.Path(root) / tag


def _check_toolchain() -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise TestAcceleratorUnavailable(
            f"swap_pass.testing.load_test_accelerator: no C++ compiler found ({compiler!r} is "
            "not on PATH). Install g++ or clang, or set CXX.")
    if not cpp_extension.is_ninja_available():
        raise TestAcceleratorUnavailable(
            "swap_pass.testing.load_test_accelerator: ninja is not available. "
            "Install it with `pip install ninja`.")


def _build() -> types.ModuleType:
    from torch.utils import cpp_extension

    _check_toolchain()
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="swap_pass_test_accelerator",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=["-O1"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # compiler or linker error: the end of its output says why
        log = str(exc)[-2000:]
        raise TestAcceleratorUnavailable(
            f"swap_pass.testing.load_test_accelerator: building the extension in {build_dir} "
            f"failed ({type(exc).__name__}; end of the log: {log}). A C++17 compiler and the "
            "torch headers must be present.") from exc


# --- registering -----------------------------------------------------------------------------


def _device_module(ext: types.ModuleType) -> types.ModuleType:
    """``torch.swaptest``: what torch looks up on a device's module (RNG, counts, sync)."""
    mod = types.ModuleType(f"torch.{DEVICE_TYPE}")
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.device_count = ext.device_count
    mod.current_device = torch.accelerator.current_device_index
    mod.set_device = torch.accelerator.set_device_index
    mod.synchronize = lambda device=None: torch.accelerator.synchronize(device)
    mod.current_stream = lambda device=None: torch.accelerator.current_stream(device)
    # As torch.cuda has them, for code written against a device module (TRL's offloading).
    mod.Stream = lambda device=None, priority=0: torch.Stream(
        device=torch.device(DEVICE_TYPE, _index(device)), priority=priority)
    mod.Event = lambda **flags: torch.Event(device=DEVICE_TYPE, **flags)
    mod.stream = _stream_context
    # Random numbers of device tensors come from the CPU generator (every op runs on CPU).
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.manual_seed = lambda seed: None
    mod.manual_seed_all = lambda seed: None
    mod.initial_seed = torch.initial_seed
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    mod.is_bf16_supported = lambda including_emulation=True: True
    # The memory cap, as torch.cuda has it: past it an allocation raises torch.OutOfMemoryError.
    mod.set_per_process_memory_fraction = (
        lambda fraction, device=None: ext.set_memory_fraction(_index(device), float(fraction)))
    mod.mem_get_info = lambda device=None: tuple(ext.memory_info(_index(device)))
    mod.get_device_properties = lambda device=None: DeviceProperties(
        name=DEVICE_TYPE, total_memory=ext.total_memory())
    return mod


@contextlib.contextmanager
def _stream_context(stream: torch.Stream | None):
    """``torch.swaptest.stream(s)``: ``s`` current on its device inside the block (as
    ``torch.cuda.stream``; None changes nothing)."""
    if stream is None:
        yield
        return
    before = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(before)


class DeviceProperties(types.SimpleNamespace):
    """What ``torch.swaptest.get_device_properties()`` returns: ``name``, ``total_memory``."""


def _index(device: int | str | torch.device | None) -> int:
    """A device index of the test accelerator (None: the current device)."""
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def _register(ext: types.ModuleType) -> None:
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch._register_device_module(DEVICE_TYPE, _device_module(ext))
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_storage=True)
    # As torch_npu's private formats: the runtime asks before a swap (Note: [Storages a device
    # cannot free] in swap_pass/runtime/device.py).
    register_free_check(DEVICE_TYPE, lambda t: _NOT_RESIZABLE if ext.is_marked_not_resizable(t)
                        else None)
    _register_inductor(ext)


# Why Inductor cannot generate code for the device in this process (None: it can).
_inductor_unavailable: str | None = "the device is not loaded"


def _register_inductor(ext: types.ModuleType) -> None:
    """Inductor's C++ code generation for the device (:mod:`.inductor`); where this torch's
    Inductor lacks an extension point it needs, the reason is kept for :func:`inductor_reason`."""
    global _inductor_unavailable
    from swap_pass.testing.accelerator import inductor

    try:
        inductor.install(DEVICE_TYPE, ext.device_count(), ext.kernel_barrier)
    except (ImportError, AttributeError, TypeError) as exc:
        _inductor_unavailable = f"Inductor cannot be registered for {DEVICE_TYPE} ({exc})"
    else:
        _inductor_unavailable = None


def inductor_reason() -> str | None:
    """Why ``torch.compile`` with Inductor cannot run on the device here; None when it can."""
    return _inductor_unavailable


_NOT_RESIZABLE = ("the test accelerator marks its storage not resizable "
                  "(swap_pass.testing.accelerator.mark_not_resizable)")


def load_test_accelerator() -> str:
    """Build (once, cached), load and register the test accelerator; return its device type.

    Idempotent. Raises :class:`TestAcceleratorUnavailable` where it cannot be built, and
    ``RuntimeError`` where another PrivateUse1 backend is registered already.

    Returns:
        ``"swaptest"``.
    """
    global _ext
    with _lock:
        if _ext is not None:
            return DEVICE_TYPE
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(
                "swap_pass.testing.load_test_accelerator: PrivateUse1 is registered as "
                f"{current!r} already. Only one PrivateUse1 backend can exist in a process.")
        ext = _build()
        _register(ext)
        _ext = ext
        return DEVICE_TYPE


def _loaded() -> types.ModuleType:
    if _ext is None:
        raise RuntimeError("swap_pass.testing.accelerator: the device is not loaded. "
                           "Call swap_pass.testing.load_test_accelerator() first.")
    return _ext


# --- knobs -----------------------------------------------------------------------------------


def set_delay(enabled: bool = True, min_ms: float = 200.0, max_ms: float = 400.0) -> None:
    """Set the delay before a queued side-stream copy starts (unless someone waits for it).

    Args:
        enabled: Whether copies are delayed at all. Default: ``True``.
        min_ms: Shortest delay. Default: ``200.0``.
        max_ms: Longest delay (each copy draws uniformly from the seeded generator). Default:
            ``400.0``.
    """
    _loaded().set_delay(enabled, min_ms, max_ms)


def set_seed(seed: int) -> None:
    """Seed the generator the copy delays are drawn from (the default seed is 0)."""
    _loaded().set_seed(seed)


def delay_settings() -> dict[str, float]:
    """The delay settings: ``enabled`` (1.0 or 0.0), ``min_ms``, ``max_ms``, ``seed``."""
    return dict(_loaded().delay_settings())


def set_order_check(enabled: bool = True) -> None:
    """Turn the order check on (the default) or off.

    On, a read of a device block (a copy on any stream, a compute op's input) that is not ordered
    after the block's last write reads ``0xFF`` bytes instead of the data, and counts in
    ``memory_stats(device)["unordered_reads"]``. Ordered means: on the same stream, or after a
    chain of ``Event.record`` / ``wait_event`` (``wait_stream``) from the writing stream, or after
    the host waited for the write (``Event.synchronize``, a stream or device synchronize, a
    blocking copy to the host, ``.item()``). Compute runs on the host here, so without the check a
    copy that misses its wait on the producer would still read produced data.
    """
    _loaded().set_order_check(enabled)


def order_check() -> bool:
    """Whether the order check is on (see :func:`set_order_check`)."""
    return bool(_loaded().order_check())


def fail_nth_resize(n: int) -> None:
    """Make the ``n``-th storage resize from now on (1 = the next) raise; 0 disarms."""
    _loaded().fail_nth_resize(n)


def resize_calls() -> int:
    """How many storage resizes went through the resize hook so far."""
    return _loaded().resize_calls()


def mark_not_resizable(tensor: torch.Tensor) -> None:
    """Make every resize of ``tensor``'s device storage raise, as a device does for storages
    it cannot resize (a private memory format). The mark ends when the block is freed."""
    _loaded().mark_not_resizable(tensor)


def memory_stats(device: int = 0) -> dict[str, int]:
    """Device allocator counters: ``allocated_bytes``, ``peak_allocated_bytes``,
    ``reserved_bytes``, ``fresh_blocks``, ``reused_blocks``, ``pending_blocks``; once they
    happened, ``unordered_reads`` (reads that got poison from the order check),
    ``unordered_frees`` (blocks freed before their allocating stream was ordered after a queued
    copy that used them), ``unordered_writes`` (writes over a block that a queued copy on
    another stream still read or wrote, not ordered after it), ``host_syncs`` (times the host
    waited for the device: a device, stream or event synchronize, a blocking copy to the host,
    ``.item()``) and ``elapsed_time_calls`` (each a host stall on torch_npu, which the device
    stands in for); ``swap_pass.testing.count_device_syncs`` reads the last two."""
    return dict(_loaded().memory_stats(device))


ORDER_COUNTERS = ("unordered_reads", "unordered_writes", "unordered_frees")


def order_counters(device: int | None = None) -> dict[str, int]:
    """The order check's counters (:func:`memory_stats`: ``unordered_reads``,
    ``unordered_writes``, ``unordered_frees``) of ``device``, or summed over every device when
    None; a test compares them before and after to assert nothing ran out of order."""
    devices = range(_loaded().device_count()) if device is None else (device,)
    stats = [memory_stats(d) for d in devices]
    return {name: sum(s.get(name, 0) for s in stats) for name in ORDER_COUNTERS}


@dataclasses.dataclass(frozen=True)
class CopyWindow:
    """One side-stream copy and the compute it could hide behind.

    Attributes:
        direction: ``"d2h"``, ``"h2d"`` or ``"d2d"``.
        bytes: The bytes copied.
        device: The device whose stream ran it.
        stream: The side stream's id.
        queued_at_ops: Compute ops issued on the device's default stream before it was queued.
        closed_by: ``"stream <id>"``: the first stream made to wait for it; ``"host"``: the host
            waited first; ``"open"``: nobody waited yet.
        ops: Compute ops issued on that stream (the host: on every stream of the device) from
            the copy's queueing to that wait: the copy's window.
        compute_bytes: The bytes those ops' operands span.
    """

    direction: str
    bytes: int
    device: int
    stream: int
    queued_at_ops: int
    closed_by: str
    ops: int
    compute_bytes: int


_DIRECTIONS = ("d2h", "h2d", "d2d")
_STREAMS_PER_DEVICE = 33  # the default stream and 32 side streams


def record_copy_windows(enabled: bool = True) -> None:
    """Start (or stop) recording a :class:`CopyWindow` per side-stream copy; clears the record.

    Each stream counts the compute issued on it: an op of the CPU fallback, an Inductor kernel,
    a copy between device blocks (one op each, and the bytes its operands span). A copy queued
    on a side stream opens a window, which the first stream made to wait for it closes with the
    compute issued on that stream meanwhile: on a device, what the copy can overlap.
    """
    _loaded().record_windows(enabled)


def copy_windows() -> list[CopyWindow]:
    """The windows recorded since :func:`record_copy_windows`, in the order of the copies."""
    out = []
    for w in _loaded().copy_windows():
        closed = w["closed_by"]
        stream = closed % _STREAMS_PER_DEVICE
        out.append(CopyWindow(
            direction=_DIRECTIONS[w["direction"]], bytes=w["bytes"], device=w["device"],
            stream=w["stream"], queued_at_ops=w["queued_at_ops"],
            closed_by="open" if closed == -2 else "host" if closed == -1 else f"stream {stream}",
            ops=w["ops"], compute_bytes=w["compute_bytes"]))
    return out


def compute_counts(device: int = 0, stream: int = 0) -> dict[str, int]:
    """Compute issued on a stream of the device so far: ``ops`` and ``bytes`` (see
    :func:`record_copy_windows`)."""
    return dict(_loaded().compute_counts(device, stream))


def pinned_stats() -> dict[str, int]:
    """Pinned host allocator counters: ``pinned_bytes_in_use`` (rounded up to powers of two),
    ``requested_bytes_in_use``, ``peak_pinned_bytes_in_use``, ``pinned_bytes_reserved`` and
    ``fresh_blocks``."""
    return dict(_loaded().pinned_stats())


def empty_cache() -> None:
    """Wait for every stream, then free the cached device and pinned blocks."""
    ext = _loaded()
    ext.empty_cache()
    ext.empty_pinned_cache()


def synchronize(device: int = -1) -> None:
    """Wait until every stream of ``device`` (all devices when -1) ran what it has queued."""
    _loaded().synchronize(device)
