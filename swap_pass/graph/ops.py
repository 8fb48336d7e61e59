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
input (an aliasing schema) and is side-effectful, so dead-code elimination keeps it. Its
``keepalive`` is the copy's source, held in the graph until the copy completes (``record_stream``
would hold the storage back until the side stream's later work completes); the graph then drops
it, and the allocator reuses it on the compute stream, already ordered after the copy.

Streams (``device_streams``), host buffers (``host_pool``: ``SwapConfig.max_host_bytes``
applies), counters (``swap_stats``) and :func:`swap_pass.reset` come from :mod:`swap_pass.runtime`.
On CPU copies are synchronous and events no-ops: the same code runs (and is tested) there.
"""

from __future__ import annotations

import dataclasses
import weakref

# The ops' signatures say List[int]: some torch releases' custom_op schema inference (2.6)
# read typing.List[int] but not list[int].
from typing import List, Optional  # noqa: UP035

import torch
from torch.fx.node import has_side_effect

from swap_pass.opt_out import swap_allowed
from swap_pass.runtime import register_reset_hook, stats
from swap_pass.runtime.device import DeviceStreams, device_streams, is_async_device
from swap_pass.runtime.freeing import byte_span
from swap_pass.runtime.host_pool import host_pool
from swap_pass.runtime.stats import SkipReason, record_skip
from swap_pass.runtime.storages import bytes_view as _bytes_view
from swap_pass.state import finalizers as _finalizers
from swap_pass.state import host_bytes as _host_bytes
from swap_pass.state import kept_on_device as _kept_on_device
from swap_pass.state import ops_lock as _lock
from swap_pass.state import released as _released
from swap_pass.state import transfers as _transfers

__all__ = ["empty_host_like", "prefetch", "swap_in", "swap_out", "wait", "pending_transfers"]


# --- pending transfers ------------------------------------------------------------------------
# Note: [Keys of pending transfers]
# A transfer is keyed by the data_ptr of the tensor it produces (swap_out's host tensor,
# prefetch's device tensor), so ``wait`` needs only that tensor, as ``ao.wait_tensor`` does. A
# swap_out's host buffer counts as in use (``_host_bytes``) until the H2D that consumes it
# completes. The registry holds no reference to it: a host copy nobody reads (forward without
# backward) dies with its last tensor, and a finalizer on its storage stops counting it
# (``HostBufferPool.forget``); one per storage, so none pile up on buffers reused every step.


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


# The tables (state.transfers, host_bytes, finalizers, released bytes: Note: [Compiled frees])
# take state.ops_lock, reentrant: finalizers may run during GC inside a locked section.


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
# In a compiled graph the graph, not swap_pass, frees a swapped tensor by dropping it after
# ``wait(host, keepalive=x)``. To count it in ``swap_stats().device_bytes_released`` as the eager
# paths do, that wait watches x's storage: when it dies while its data is only on the host, its
# bytes count as released until the prefetch brings them back (or the host copy dies unread). A
# source the graph keeps (also an output, or reused in place by Inductor's memory planning) is not.


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
# host buffer): its block goes back to the compute stream's pool while the copy out may still read
# it, so its storage's finalizer orders the compute stream after the copy unless a wait did. It
# asks the transfer (``ordered``), not the registry: the host copy may have died first (an aborted
# graph's locals die in any order), which drops the transfer from the registry but orders nothing.


def _source_died_unwaited(transfer: _Transfer) -> None:
    """A swapped-out tensor died before its ``wait`` (Note: [Sources that die unwaited])."""
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
# A transfer is ordered against the stream current when it started: swap_out's source was made
# (and is freed) there, prefetch allocates its destination there, and the calling graph runs on
# it. It is kept on the transfer, never looked up again: a finalizer (``_source_died_unwaited``,
# ``_output_died``) may run while any stream is current (the runtime's side stream during a copy,
# a user's stream), and the allocator hands a freed block to its stream's next allocation at once.


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
# On CUDA, ``copy_`` with a non-contiguous side allocates a full-size device temporary on the
# current stream (the side stream, whose cached blocks compute never reuses) and copies twice. So
# every graph-path copy is contiguous on both sides. A strided tensor (transposed, permuted,
# sliced, expanded) copies the bytes of its storage it spans (``byte_span``, as the eager runtime
# does): its host tensor views a buffer of exactly those bytes with its own strides, and
# ``prefetch`` restores into ``empty_strided(size, stride)``, whose storage is that span again.
# Bytes between the elements (a slice's gaps) travel along and are never read.


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
    """The destination and source of ``host``'s copy into ``out``: contiguous when ``host`` is laid
    out as ``swap_out`` returns it; else (an AOTAutograd copy, say) element by element."""
    if host.is_contiguous() and out.is_contiguous():
        return out, host
    if host.stride() == out.stride():
        return _span_bytes(out), _span_bytes(host)
    return out, host


# --- swap_out ---------------------------------------------------------------------------------

# Note: [Never inside a CUDA graph]
# The four ops use pooled host buffers and side streams: a CUDA graph replay would copy to and
# from the capture's host address, which the pool has handed on since. Under reduce-overhead,
# Inductor without graph partition captures no graph holding a CPU tensor (the host copies): it
# logs "skipping cudagraphs due to cpu device". With ``torch._inductor.config.graph_partition``,
# ``torch.Tag.cudagraph_unsafe`` (where torch has it) makes each op a partition boundary. Any
# other capture (``torch.cuda.graph`` around a compiled step) is refused when an op runs
# (``_refuse_capture``): swap_out, prefetch and swap_in raise before taking a buffer or
# allocating, a wait with a copy pending before ordering anything.
_UNSAFE_IN_CUDA_GRAPHS = ((torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe")
                          else ())


# Note: [swap_out's input layout]
# Without swap, a saved tensor is a forward graph output, and Inductor gives it its traced stride
# order when lowering its producer; a reader needing exactly those strides (SDPA) reads that
# buffer. With swap it feeds ``swap_out``, an extern kernel lowered right after its producer:
# without a layout constraint (Inductor ignores the default ``needs_exact_strides`` for a node a
# custom pass inserted) it freezes the producer's flexible layout to contiguous, and a reader
# needing the traced strides gets a second, transposed buffer from the same kernel, whose loops
# then vectorize differently (Sleef sin/cos instead of std::sin/std::cos for a RoPE'd query): the
# saved value changes in the last bits. ``needs_fixed_stride_order`` keeps the traced order.
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


# state.kept_on_device: swap_out results no_swap() kept on the device (a copy of the source), by
# data_ptr, each until its storage dies; their prefetch is a plain copy, counted nowhere.


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
    """The device tensor to copy into: ``size``/``stride``, or contiguous like ``host`` if empty."""
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

    The destination is allocated on the compute stream with the original ``size`` and ``stride``
    (both empty: contiguous with ``host``'s shape, keeping symbolic sizes out of the arguments).
    Pair with ``wait(out, keepalive=host)`` before the first reader. ``after`` (ignored) is a
    tensor computed at the planned position: no scheduler starts the copy (or allocates) before it.
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
# graph holding it up to the wait keeps that memory from being freed or handed to another kernel
# while the copy runs (Note: [One buffer from swap_out to wait] in aot_pass.py). A compiler that
# materializes x twice gives the wait a second buffer and drops the first after swap_out: freed,
# compute waits for the copy at once (no overlap); reused for a later kernel's output, that kernel
# may write it under the copy (a wrong host copy on an asynchronous device). The wait checks that
# the copy's storage is still alive (its finalizer has not run) and is the keepalive's (a data
# pointer alone could be a new buffer at a freed address). Else it raises on a device with streams
# (the host copy may be corrupt); on CPU, whose copies completed inside swap_out, it warns once.


def _check_keepalive(transfer: _Transfer | None, keepalive: torch.Tensor) -> None:
    """Raise or warn if ``keepalive`` is not the storage the swap_out ``transfer`` read."""
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
    from swap_pass.state import warn_once

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

    A ``t`` with no copy pending returns at once, where ``ao.wait_tensor`` raises: a retained
    graph's second backward waits again on copies its first completed, and ``swap_in`` on a CPU
    copy has waited already; both are correct graphs. Copies are keyed by data pointer only, so
    "already waited for" and "never copied" cannot be told apart without holding every tensor.

    Args:
        t: The output of ``swap_out`` or ``prefetch``.
        keepalive: The copy's source, kept alive in the graph up to this point. Default: ``None``.
    """
    return torch.ops.swap_pass.wait.default(t, keepalive)
