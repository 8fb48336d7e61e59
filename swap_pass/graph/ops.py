"""``torch.ops.swap_pass.*``: the swap ops that graphs hold, on the shared runtime.

Forward graph (one saved layer input ``x``)::

    host = swap_pass.swap_out(x)           # start D2H into a pooled host buffer (d2h stream)
    ...                                    # the layer that reads x runs meanwhile
    host = swap_pass.wait(host, x)         # compute stream waits for the D2H; x may now die

Backward graph::

    y = ...                                # computed right before the planned start
    dev = swap_pass.prefetch(host, device, size, stride, after=y)  # one layer ahead: start H2D
    ...                                    # the layer after it runs backward
    dev = swap_pass.wait(dev, host)        # before the first reader: wait, release host buffer

``swap_in`` is ``prefetch`` and ``wait`` in one, for graphs built without prefetch.

The ops are functional (``swap_out`` and ``prefetch`` return new tensors), so Dynamo, ``make_fx``,
``torch.export``, AOTAutograd and Inductor can trace, move and compile them; ``wait`` returns its
input (an aliasing schema) and is marked side-effectful so dead-code elimination keeps it. The
``keepalive`` argument of ``wait`` is the source of the transfer: it keeps that tensor alive in
the graph until the copy is complete, instead of ``record_stream`` (which would hold the
storage back from the allocator until the side stream's later work completes).
Freeing is the graph's job: once ``wait`` ran, the graph drops the source and the allocator
reuses it on the compute stream, which is already ordered after the copy.

Everything goes through :mod:`swap_pass.runtime`: streams from ``device_streams``, host buffers
from ``host_pool`` (so ``SwapConfig.max_host_bytes`` applies), counters in ``swap_stats``, and
:func:`swap_pass.reset` drops pending transfers. On CPU the copies are synchronous and every
event is a no-op, so the same code runs (and is tested) without an accelerator.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

# The ops' signatures say List[int]: some torch releases' custom_op schema inference (2.6)
# read typing.List[int] but not list[int].
from typing import List, Optional  # noqa: UP035

import torch
from torch.fx.node import has_side_effect

from swap_pass.opt_out import swap_allowed
from swap_pass.runtime import register_reset_hook, stats
from swap_pass.runtime.device import DeviceStreams, device_streams, is_async_device
from swap_pass.runtime.host_pool import host_pool
from swap_pass.runtime.ownership import byte_span
from swap_pass.runtime.skips import SkipReason, record_skip
from swap_pass.runtime.swap_tensors import _bytes_view

__all__ = ["empty_host_like", "prefetch", "swap_in", "swap_out", "wait", "pending_transfers"]


# --- pending transfers ------------------------------------------------------------------------
# Note: [Keys of pending transfers]
# A transfer is keyed by the data_ptr of the tensor it produces (the host tensor of swap_out,
# the device tensor of prefetch), so that ``wait`` needs only that tensor, as in PyTorch's
# ``ao.wait_tensor``. A swap_out's host buffer counts as in use (``_host_bytes``) until the H2D
# that consumes it completes; the registry holds no reference to it, so a host copy nobody will
# read (forward without backward) dies with its last tensor, and a finalizer on its storage
# stops counting it (``HostBufferPool.forget``). One finalizer per storage: pooled buffers are
# reused every step, and finalizers must not pile up on them.


@dataclasses.dataclass
class _Transfer:
    """A started copy: its completion event, the compute stream it started on (Note: [The
    compute stream of a transfer]), and the host buffer to release once waited for."""

    event: object
    device: torch.device
    use_streams: bool
    compute: torch.Stream | None = None
    release: torch.Tensor | None = None
    ordered: bool = False  # compute waited on event: Note: [Sources that die unwaited]
    # swap_out: the data pointer of the storage its copy reads, and whether that storage died
    # (Note: [The keepalive is the copy's source])
    source: int = 0
    source_died: bool = False


_lock = threading.RLock()  # finalizers may run during GC inside a locked section
_transfers: dict[int, _Transfer] = {}
_host_bytes: dict[int, int] = {}
_finalizers: dict[int, weakref.finalize] = {}
_released: dict[int, int] = {}  # host key -> device bytes freed meanwhile (Note: [Compiled frees])


def pending_transfers() -> int:
    """Number of started copies not yet waited for, plus host buffers not yet swapped back."""
    with _lock:
        return len(_transfers) + len(_host_bytes)


def _track_host_buffer(buf: torch.Tensor) -> None:
    key = buf.data_ptr()
    with _lock:
        _host_bytes[key] = buf.numel()
        fin = _finalizers.get(key)
        if fin is None or not fin.alive:
            _finalizers[key] = weakref.finalize(buf.untyped_storage(), _storage_died, key)


def _storage_died(key: int) -> None:
    """A pooled host buffer died: stop counting it, and drop a copy into it nobody waited for."""
    with _lock:
        _finalizers.pop(key, None)
        nbytes = _host_bytes.pop(key, None)
        _transfers.pop(key, None)
    _unrelease(key)
    if nbytes is not None:
        host_pool().forget(nbytes)


# Note: [Compiled frees]
# In a compiled graph the device copy of a swapped tensor is freed by the graph dropping it
# after ``wait(host, keepalive=x)``, not by swap_pass. To count it in
# ``swap_stats().device_bytes_released`` like the eager paths do, that wait watches x's storage:
# when it dies while its data is still only on the host, its bytes count as released, until
# the prefetch that brings them back (or the host copy dies unread). A source the graph keeps
# (also an output, or reused in place by Inductor's memory planning) is not counted.


def _watch_source(host: torch.Tensor, source: torch.Tensor) -> None:
    key, nbytes = host.data_ptr(), _nbytes(source)
    with _lock:
        if key not in _host_bytes or key in _released:
            return
    weakref.finalize(source.untyped_storage(), _source_died, key, nbytes)


def _source_died(key: int, nbytes: int) -> None:
    with _lock:
        if key not in _host_bytes or key in _released:
            return  # already brought back: the graph kept the source past its restore
        _released[key] = nbytes
    stats.record_released(nbytes)


def _unrelease(key: int) -> None:
    with _lock:
        nbytes = _released.pop(key, 0)
    if nbytes:
        stats.record_released(-nbytes)


def _output_died(key: int, transfer: _Transfer) -> None:
    """A prefetched tensor died before anyone waited for it: order its allocating stream after
    the copy that still writes its memory, and give its host buffer back."""
    with _lock:
        if _transfers.get(key) is not transfer:
            return
        del _transfers[key]
    _order_compute_after(transfer)
    if transfer.release is not None:  # the copy may still read it: its event goes with it
        host_pool().release_when_unread(transfer.release, transfer.event)  # lock-free


# Note: [Sources that die unwaited]
# A swapped-out tensor can die before its ``wait`` (an exception later in the forward, a refused
# host buffer): its block goes back to the compute stream's pool while the copy out may still
# read it, so the finalizer on its storage orders the compute stream after the copy, unless a
# wait did already. It asks the transfer (``ordered``), not the registry: the host copy may have
# died first (the locals of an aborted graph die in any order), which takes the transfer out of
# the registry but orders nothing.


def _source_died_unwaited(transfer: _Transfer) -> None:
    """A swapped-out tensor died before its ``wait``: order its allocating stream after the copy
    that may still read it (Note: [Sources that die unwaited])."""
    transfer.source_died = True  # Note: [The keepalive is the copy's source]
    if not transfer.ordered:
        _order_compute_after(transfer)


def _take_host_buffer(host: torch.Tensor) -> torch.Tensor | None:
    """The whole pooled buffer behind ``host`` (flat bytes), if it is still counted as in use."""
    with _lock:
        nbytes = _host_bytes.pop(host.data_ptr(), None)
    _unrelease(host.data_ptr())
    if nbytes is None:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage())


# Note: [The compute stream of a transfer]
# The stream a transfer is ordered against is the one current when it started: swap_out's source
# was made (and is freed) there, prefetch allocates its destination there, and the graph that
# called the op runs on it. It is kept on the transfer and never looked up again: a finalizer
# (``_source_died_unwaited``, ``_output_died``) may run while any stream is current (inside the
# runtime's own side-stream context during a copy, or a user's stream context), and the caching
# allocator hands a freed block to its allocating stream's next allocation at once.


def _order_compute_after(transfer: _Transfer) -> None:
    """Make the transfer's compute stream wait for its copy (a stream wait, no host sync): its
    source or destination may be freed now (Note: [The compute stream of a transfer])."""
    ds = device_streams(transfer.device, transfer.use_streams)
    ds.wait(transfer.compute, transfer.event)
    transfer.ordered = True


@register_reset_hook
def _reset_pending() -> None:
    with _lock:
        dropped = list(_host_bytes.values())  # one forget per buffer: each has its block size
        pending = list(_transfers.values())
        held = [(t.release, t.event) for t in pending if t.release is not None]
        released = sum(_released.values())
        _host_bytes.clear()
        _transfers.clear()
        _released.clear()
    if released:
        stats.record_released(-released)
    for nbytes in dropped:
        host_pool().forget(nbytes)
    for transfer in pending:  # their outputs may die any time now: see _output_died
        _order_compute_after(transfer)
    for buf, event in held:
        host_pool().release(buf, event)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- graph capture ----------------------------------------------------------------------------


def _refuse_capture(api: str, ds: DeviceStreams, stream: torch.Stream | None) -> None:
    """Raise when ``stream`` is capturing a graph (Note: [Never inside a CUDA graph])."""
    if ds.is_capturing(stream):
        raise RuntimeError(
            f"swap_pass.{api}: called while the current stream ({stream}) is capturing a graph "
            "(torch.cuda.graph, torch.accelerator.Graph, CUDA graphs of mode='reduce-overhead'). "
            "A swap must never be captured: a replay would copy to and from host memory the pool "
            "has handed out since. Run swapped graphs uncaptured, e.g. compile with "
            "mode='default' or mode='max-autotune-no-cudagraphs'.")


# --- layouts ----------------------------------------------------------------------------------

# Note: [Contiguous copies]
# A copy between tensors of different layouts is not one transfer: on CUDA, ``copy_`` of a
# non-contiguous side allocates a full-size device temporary on the current stream (the side
# stream, whose cached blocks compute never reuses) and copies twice. So every copy of the graph
# path is contiguous on both sides. A contiguous tensor copies as it is. A strided one (a
# transposed, permuted, sliced or expanded saved tensor) copies the bytes of its storage it
# spans (``byte_span``, as the eager runtime does): its host tensor views a buffer of exactly
# those bytes with the tensor's own strides, and ``prefetch`` restores into
# ``empty_strided(size, stride)``, whose storage is exactly that span again. Bytes between the
# elements (a slice's gaps) travel along and are never read.


def _contiguous(t: torch.Tensor) -> bool:
    """Contiguity without guards on symbolic sizes (False when unknown)."""
    try:
        from torch._prims_common import is_contiguous_or_false
    except ImportError:  # older torch: static shapes only
        return all(isinstance(n, int) for n in t.shape) and t.is_contiguous()
    return bool(is_contiguous_or_false(t))


def empty_host_like(x: torch.Tensor) -> torch.Tensor:
    """An empty host tensor laid out as ``swap_out(x)`` returns it: contiguous when ``x`` is,
    else with ``x``'s strides (Note: [Contiguous copies])."""
    if _contiguous(x):
        return torch.empty(x.shape, dtype=x.dtype, device="cpu")
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


def _span_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of the bytes of ``t``'s storage that ``t`` spans."""
    lo, hi = byte_span([t])
    return _bytes_view(t.untyped_storage(), lo, hi - lo)


def _host_view(buf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x``'s host tensor over the pooled bytes ``buf`` (``x``'s span when it is strided)."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype)
    if x.is_contiguous():
        return buf.view(x.dtype).view(x.shape)
    lo, _ = byte_span([x])
    return buf.view(x.dtype).as_strided(x.shape, x.stride(),
                                        x.storage_offset() - lo // x.element_size())


def _h2d_sides(host: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The destination and source of ``host``'s copy into ``out``: both contiguous when ``host``
    is laid out as ``swap_out`` returns it. A host tensor from elsewhere (a contiguous copy
    AOTAutograd made of it, say) copies element by element, correct but not one transfer."""
    if host.is_contiguous() and out.is_contiguous():
        return out, host
    if host.stride() == out.stride():
        return _span_bytes(out), _span_bytes(host)
    return out, host


# --- swap_out ---------------------------------------------------------------------------------

# Note: [Never inside a CUDA graph]
# The four ops touch host buffers taken from the pool at run time and side streams: captured
# into a CUDA graph, each replay would copy to and from the host address of the capture, which
# the pool has given to another tensor since. Under ``mode="reduce-overhead"`` Inductor without
# graph partition captures no graph that has a CPU tensor (the host copies are ones): it logs
# "skipping cudagraphs due to cpu device" and runs the graph uncaptured. With graph partition
# (``torch._inductor.config.graph_partition``), ``torch.Tag.cudagraph_unsafe`` (where the torch
# has it) makes each of these ops a partition boundary, never inside a captured partition. Any
# other capture (``torch.cuda.graph`` around a compiled step, say) is refused when an op runs:
# swap_out, prefetch and swap_in raise before they take a buffer or allocate, and a wait with a
# copy pending raises before it orders anything (``_refuse_capture``).
_UNSAFE_IN_CUDA_GRAPHS = ((torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe")
                          else ())



# Note: [swap_out's input layout]
# Without swap, a saved tensor is an output of the forward graph, and Inductor gives an output its
# traced stride order as soon as it lowers the node that makes it; a later reader that needs
# those strides (SDPA: exactly the traced ones) then reads that buffer. With swap, the saved tensor
# feeds ``swap_out`` instead, an extern kernel lowered right after its producer: without a layout
# constraint (a custom pass inserted it, so Inductor ignores the default ``needs_exact_strides``)
# it freezes the producer's still flexible layout to contiguous, and a reader that needs the
# traced strides gets a second, transposed buffer from the same kernel. That kernel's loops then
# run in another order and vectorize differently (Sleef sin/cos instead of std::sin/std::cos for
# a RoPE'd query), which changes the saved value in the last bits. ``needs_fixed_stride_order``
# makes Inductor give the input its traced stride order, as for a graph output.
@torch.library.custom_op("swap_pass::swap_out", mutates_args=(),
                         tags=(torch.Tag.needs_fixed_stride_order, *_UNSAFE_IN_CUDA_GRAPHS))
def swap_out(x: torch.Tensor, max_host_bytes: int = -1, use_streams: bool = True,
             pin_memory: bool = True) -> torch.Tensor:
    """Start copying ``x`` to a pooled host buffer on the device-to-host stream.

    Args:
        x: The activation to move (any strides: Note: [Contiguous copies]).
        max_host_bytes: ``SwapConfig.max_host_bytes``; ``-1`` for no cap. Default: ``-1``.
        use_streams: Copy on a side stream (accelerators only). Default: ``True``.
        pin_memory: ``SwapConfig.pin_memory``: a page-locked host buffer (accelerators only).
            Default: ``True``.

    Returns:
        A CPU tensor with ``x``'s values once ``wait`` has run on it: contiguous when ``x`` is,
        else with ``x``'s strides over the bytes ``x`` spans.

    Raises:
        RuntimeError: The current stream is capturing a graph.
        HostMemoryError: No host buffer could be had (``max_host_bytes``, allocation).
    """
    if not swap_allowed():  # Note: [Opting out] in swap_pass/opt_out.py
        return _keep_on_device(x)
    ds = device_streams(x.device, use_streams)
    compute = ds.compute_stream()  # Note: [The compute stream of a transfer]
    _refuse_capture("swap_out", ds, compute)
    src = x if x.is_contiguous() else _span_bytes(x)
    pin = pin_memory and ds.pin_memory
    buf, last_copy = host_pool().take(_nbytes(src), pin=pin,
                                      max_host_bytes=None if max_host_bytes < 0 else max_host_bytes)
    host = _host_view(buf, x)
    ready = ds.record_event(compute)
    stream = ds.d2h_stream()
    ds.wait(stream, ready)
    ds.wait(stream, last_copy)  # the buffer's last copy, if still running
    ds.copy(stream, host if src is x else buf, src, pinned=pin)
    transfer = _Transfer(ds.record_event(stream), x.device, use_streams, compute,
                         source=x.untyped_storage().data_ptr())
    with _lock:
        _transfers[host.data_ptr()] = transfer
    weakref.finalize(x.untyped_storage(), _source_died_unwaited, transfer)
    _track_host_buffer(buf)
    stats.record_swap_out(_nbytes(src))
    return host


# swap_out results that no_swap() kept on the device (a copy of the source), by data_ptr: their
# prefetch is a plain copy, counted nowhere. Each leaves with its storage.
_kept_on_device: dict[int, bool] = {}


def _keep_on_device(x: torch.Tensor) -> torch.Tensor:
    """Inside ``no_swap()``: a device copy of ``x`` in place of its host copy, counted as kept."""
    record_skip(SkipReason.NO_SWAP, _nbytes(x), where="swap_pass::swap_out")
    kept = x.clone(memory_format=torch.contiguous_format)
    if kept.numel():
        _kept_on_device[kept.data_ptr()] = True
        weakref.finalize(kept.untyped_storage(), _kept_on_device.pop, kept.data_ptr(), None)
    return kept


@swap_out.register_fake
def _(x: torch.Tensor, max_host_bytes: int = -1, use_streams: bool = True,
      pin_memory: bool = True) -> torch.Tensor:
    return empty_host_like(x)


# --- prefetch and swap_in ---------------------------------------------------------------------


def _empty_like_original(host: torch.Tensor, device: torch.device, size: list[int],
                         stride: list[int]) -> torch.Tensor:
    """The device tensor to copy into: ``size``/``stride``, or contiguous like ``host`` when
    empty."""
    if not size and host.dim():
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    return torch.empty_strided(size, stride, dtype=host.dtype, device=device)


def _start_h2d(host: torch.Tensor, device: torch.device, size: list[int], stride: list[int],
               use_streams: bool, api: str) -> torch.Tensor:
    if host.numel() and _kept_on_device.get(host.data_ptr()):  # never left: see _keep_on_device
        return _empty_like_original(host, device, size, stride).copy_(host)
    ds = device_streams(device, use_streams)
    compute = ds.compute_stream()  # Note: [The compute stream of a transfer]
    _refuse_capture(api, ds, compute)
    out = _empty_like_original(host, device, size, stride)  # on the compute stream
    dst, src = _h2d_sides(host, out)  # Note: [Contiguous copies]
    ready = ds.record_event(compute)
    stream = ds.h2d_stream()
    ds.wait(stream, ready)
    ds.copy(stream, dst, src, pinned=ds.pin_memory and host.is_pinned())
    transfer = _Transfer(ds.record_event(stream), out.device, use_streams, compute,
                         release=_take_host_buffer(host))
    with _lock:
        _transfers[out.data_ptr()] = transfer
    weakref.finalize(out.untyped_storage(), _output_died, out.data_ptr(), transfer)
    stats.record_swap_in(_nbytes(src))
    return out


@torch.library.custom_op("swap_pass::prefetch", mutates_args=(), tags=_UNSAFE_IN_CUDA_GRAPHS)
def prefetch(host: torch.Tensor, device: torch.device, size: List[int], stride: List[int],
             use_streams: bool = True, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Start copying ``host`` back to ``device`` on the host-to-device stream.

    The destination is allocated on the compute stream with the original ``size`` and
    ``stride`` (both empty: contiguous with ``host``'s shape, which keeps symbolic sizes out of
    the op's arguments). Pair with ``wait(out, keepalive=host)`` before the first reader.
    ``after`` is a tensor computed at the prefetch's planned position, so that no scheduler
    starts the copy (and allocates its destination) before that compute; the op ignores it.
    """
    return _start_h2d(host, device, size, stride, use_streams, "prefetch")


@prefetch.register_fake
def _(host, device, size, stride, use_streams=True, after=None):
    return _empty_like_original(host, device, size, stride)


@torch.library.custom_op("swap_pass::swap_in", mutates_args=(), tags=_UNSAFE_IN_CUDA_GRAPHS)
def swap_in(host: torch.Tensor, device: torch.device, size: List[int], stride: List[int],
            use_streams: bool = True) -> torch.Tensor:
    """Copy ``host`` back to ``device`` and wait for it: ``prefetch`` and ``wait`` in one."""
    out = _start_h2d(host, device, size, stride, use_streams, "swap_in")
    _wait_for(out)
    return out


@swap_in.register_fake
def _(host, device, size, stride, use_streams=True):
    return _empty_like_original(host, device, size, stride)


# --- wait -------------------------------------------------------------------------------------

_lib = torch.library.Library("swap_pass", "FRAGMENT")
# ``after``: a tensor computed at the wait's planned position, so that no scheduler runs the
# wait before the compute its copy hides behind (the wait itself ignores it).
_lib.define("wait(Tensor(a) t, Tensor? keepalive=None, Tensor? after=None) -> Tensor(a)",
            tags=_UNSAFE_IN_CUDA_GRAPHS)


def _wait_for(t: torch.Tensor) -> _Transfer | None:
    """Order the compute stream after the copy that produced ``t``; release its host buffer.
    Returns the transfer completed here (None: nothing was pending)."""
    with _lock:
        transfer = _transfers.get(t.data_ptr())
    if transfer is None:  # already waited for (or a synchronous CPU copy waited by swap_in)
        return None
    _refuse_capture("wait", device_streams(transfer.device, transfer.use_streams),
                    transfer.compute)
    with _lock:
        if _transfers.get(t.data_ptr()) is not transfer:
            return None  # taken meanwhile (reset() on another thread), which ordered it
        del _transfers[t.data_ptr()]
    _order_compute_after(transfer)
    if transfer.release is not None:  # a retained graph may read it again; the copy's event
        host_pool().release_when_unread(transfer.release, transfer.event)  # goes with it
    return transfer


# Note: [The keepalive is the copy's source]
# ``wait(h, keepalive=x)`` must receive the very tensor whose storage swap_out's copy reads: the
# graph holding it up to the wait is what keeps its memory from being freed or handed to another
# kernel while the copy runs (Note: [One buffer from swap_out to wait] in aot_pass.py). A
# compiler that materializes x twice passes the wait a second buffer and drops the first right
# after swap_out: freed, the compute stream waits for the copy at once (no overlap); reused in
# place for a later kernel's output, that kernel may write it under the copy, and the host copy
# is wrong on an asynchronous device. The wait compares the keepalive's storage with the one the
# copy read: the same storage is alive (its finalizer has not run) and the keepalive's data
# pointer is the one the copy read (a data pointer alone could be a new buffer at a freed
# address). Where they differ on a device with streams it raises (the host copy may be corrupt,
# and no step may go on with it); on CPU, whose copies completed inside swap_out, it warns once.


def _check_keepalive(transfer: _Transfer | None, keepalive: torch.Tensor) -> None:
    """Raise or warn if ``keepalive`` is not the storage the swap_out ``transfer`` read (see
    the Note)."""
    if (transfer is None or not transfer.source or (
            not transfer.source_died
            and keepalive.untyped_storage().data_ptr() == transfer.source)):
        return
    what = ("swap_pass::wait: the tensor this graph keeps alive up to the wait is not the one "
            "swap_out copied (the compiler materialized it twice), so the copy's source could "
            "be freed or written while the copy runs")
    fix = ("Compile with make_swap_backend(inner='aot_eager') or swap_pass.compile_layers, and "
           "report the torch version and the inner compiler.")
    if is_async_device(transfer.device):
        raise RuntimeError(f"{what}; on {transfer.device} the host copy may be corrupt. {fix}")
    from swap_pass.runtime.skips import warn_once

    warn_once("keepalive_not_source", "",
              f"{what} (harmless on CPU, where the copy completed inside swap_out; on an "
              f"accelerator the step would stop here). {fix} (Shown once.)")


@torch.library.impl("swap_pass::wait", "CompositeExplicitAutograd")
def _wait_impl(t: torch.Tensor, keepalive: torch.Tensor | None = None,
               after: torch.Tensor | None = None) -> torch.Tensor:
    transfer = _wait_for(t)
    if keepalive is not None and t.device.type == "cpu" and keepalive.numel():
        _check_keepalive(transfer, keepalive)  # a swap_out's host copy
    if keepalive is not None and t.device.type == "cpu" and keepalive.numel():
        _watch_source(t, keepalive)  # a swap_out's host copy (Note: [Compiled frees])
    # a view, as the schema says: ops below autograd may not return inputs
    return torch.ops.aten.alias.default(t)


@torch.library.register_fake("swap_pass::wait")
def _wait_fake(t: torch.Tensor, keepalive: torch.Tensor | None = None,
               after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.aten.alias.default(t)


has_side_effect(torch.ops.swap_pass.wait.default)


def wait(t: torch.Tensor, keepalive: torch.Tensor | None = None) -> torch.Tensor:
    """Complete the copy that produced ``t`` (from ``swap_out`` or ``prefetch``) and return ``t``.

    A ``t`` with no copy pending returns at once, where PyTorch's ``ao.wait_tensor`` raises: a
    retained graph's second backward runs each ``wait`` again on a tensor whose copy its first
    backward completed, and ``swap_in`` on a synchronous CPU copy has waited already; both are
    correct graphs. A pending copy is keyed by ``t``'s data pointer only, so "already waited for"
    and "never copied" cannot be told apart without holding every produced tensor.

    Args:
        t: The output of ``swap_out`` or ``prefetch``.
        keepalive: The copy's source, kept alive in the graph up to this point. Default: ``None``.
    """
    return torch.ops.swap_pass.wait.default(t, keepalive)
