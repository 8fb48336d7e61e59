"""What an accelerator asks of the graph ops: contiguous copies, the compute stream fixed when a
copy starts, no swap inside graph capture, and ``SwapConfig.pin_memory`` honoured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass import SwapConfig, make_swap_backend
from swap_pass.graph import ops
from swap_pass.runtime.device import device_streams
from swap_pass.testing import accelerator as device_knobs
from tests.conftest import on_test_accelerator

from .helpers import twin

OPS = torch.ops.swap_pass


# --- contiguous copies ------------------------------------------------------------------------


def _strided_inputs():
    """Saved tensors whose layout is not contiguous (and one that is, for reference)."""
    base = torch.randn(6, 10)
    return {
        "contiguous": torch.randn(2, 4, 8),
        "transposed": base.t(),
        "permuted": torch.randn(2, 3, 4, 5).permute(0, 2, 1, 3),
        "sliced": base[2:5, 1:7],
        "expanded": torch.randn(4, 1).expand(4, 6),
    }


def _layout(side: torch.Tensor | torch.UntypedStorage) -> tuple[bool, str]:
    """Whether one side of a copy is dense (a contiguous tensor, or a storage), and its layout."""
    if isinstance(side, torch.UntypedStorage):
        return True, f"storage of {side.nbytes()} bytes"
    return side.is_contiguous(), f"{tuple(side.shape)} stride {side.stride()}"


@pytest.fixture
def copies(monkeypatch):
    """The layouts of both sides of every copy the runtime issues through
    ``DeviceStreams.copy`` during the test (the modelled streams' ``copy`` under the stream
    model). Each copy still runs; no tensor is held past it."""
    seen = []
    cls = type(device_streams(torch.device("cpu")))
    original = cls.copy

    def spy(self, stream, dst, src, pinned=False):
        seen.append((_layout(dst), _layout(src)))
        return original(self, stream, dst, src, pinned=pinned)

    monkeypatch.setattr(cls, "copy", spy)
    return seen


def _assert_all_dense(seen: list) -> None:
    assert seen, "no copy went through DeviceStreams.copy"
    for (dst_dense, dst), (src_dense, src) in seen:
        assert dst_dense and src_dense, f"a copy with a non-contiguous side: {src} -> {dst}"


@pytest.mark.parametrize("kind", list(_strided_inputs()))
@pytest.mark.parametrize("op", ["prefetch", "swap_in"])
def test_every_copy_of_a_round_trip_is_contiguous_on_both_sides(kind, op, copies):
    x = _strided_inputs()[kind]
    keep = x.clone()
    host = OPS.wait(OPS.swap_out(x), x)
    restore = getattr(OPS, op).default(host, x.device, list(x.shape), list(x.stride()))
    dev = OPS.wait(restore, host) if op == "prefetch" else restore
    assert torch.equal(dev, x) and dev.stride() == x.stride()
    assert torch.equal(x, keep)  # the user's tensor keeps its values
    _assert_all_dense(copies)
    assert len(copies) == 2
    del host, dev, restore
    assert swap_pass.swap_stats().host_bytes_in_use == 0 and ops.pending_transfers() == 0


def test_a_non_contiguous_host_copy_holds_the_bytes_the_tensor_spans():
    base = torch.randn(6, 10)
    x = base[2:5, 1:7]  # 3 rows of 10 elements apart: 2 * 10 + 6 elements spanned
    host = OPS.wait(OPS.swap_out(x), x)
    assert host.stride() == x.stride() and torch.equal(host, x)
    assert swap_pass.swap_stats().swapped_out_bytes == (2 * 10 + 6) * 4
    del host


@pytest.mark.parametrize("kind", ["transposed", "sliced"])
def test_a_host_tensor_laid_out_otherwise_is_restored_exactly(kind):
    """A contiguous host tensor (as AOTAutograd may pass one) still restores x's layout."""
    x = _strided_inputs()[kind]
    host = x.contiguous()
    dev = OPS.wait(OPS.prefetch(host, x.device, list(x.shape), list(x.stride())), host)
    assert torch.equal(dev, x) and dev.stride() == x.stride()
    del host, dev
    assert ops.pending_transfers() == 0


class _Block(nn.Module):
    """Reads its input through ``sin`` (which saves it); its output is transposed, so the next
    block's saved input is a non-contiguous view (the partitioner saves the transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return torch.matmul(torch.sin(x), self.w).transpose(1, 2)


class _Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x):
        x = x * 2
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _train(model, backend, data):
    torch._dynamo.reset()
    loss = torch.compile(model, backend=backend, fullgraph=True)(data)
    loss.backward()
    return loss.detach()


def test_compiled_transposed_layer_input_copies_contiguous_bytes_and_is_exact(copies):
    torch.manual_seed(0)
    model, data = _Stack(), torch.randn(2, 8, 8, 8)
    ref = twin(model)
    keep = data.clone()
    backend = make_swap_backend("aot_eager")
    loss = _train(model, backend, data)
    fw = backend.partitions[-1].forward
    saved = [n.args[0].meta["val"] for n in fw.graph.nodes if n.target is OPS.swap_out.default]
    assert saved and not any(v.is_contiguous() for v in saved)  # the graph swaps strided inputs
    assert swap_pass.swap_stats().swap_ins == len(saved)
    _assert_all_dense(copies)
    ref_loss = _train(ref, "aot_eager", data)
    assert torch.equal(loss, ref_loss)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert torch.equal(data, keep)
    torch._dynamo.reset()


# --- the compute stream of a transfer ---------------------------------------------------------
# A finalizer can run while any stream is current (inside the runtime's own side-stream context
# during a copy, or a user's stream context): the copy it orders must be ordered against the
# stream the transfer started on, which allocated (or freed) its memory. On the test accelerator
# with side-stream copies held until someone waits for them: the compute stream's next allocation
# takes the dying tensor's block, and an unordered free fails the test at teardown.

N = 64 * 64


@on_test_accelerator
def test_a_source_dying_unwaited_under_another_stream_orders_the_stream_it_started_on(
        swaptest_held):
    dev = swaptest_held
    x = torch.arange(float(N), device=dev).view(64, 64)
    host = OPS.swap_out(x)  # queued on the d2h stream; x was made on the compute stream
    user = torch.Stream(device=dev)
    with user:
        del x  # dies before its wait, while another stream is current
    later = torch.full((N,), 7.0, device=dev)  # takes x's block
    assert torch.equal(OPS.wait(host), torch.arange(float(N)).view(64, 64))
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))


@on_test_accelerator
def test_a_prefetched_tensor_dying_unwaited_under_another_stream_orders_its_allocating_stream(
        swaptest_held):
    dev = swaptest_held
    x = torch.arange(float(N), device=dev).view(64, 64)
    host = OPS.wait(OPS.swap_out(x), x)
    del x
    out = OPS.prefetch(host, dev, [], [])  # allocated on the compute stream
    user = torch.Stream(device=dev)
    with user:
        del out  # dies before its wait, while another stream is current
    later = torch.full((N,), 7.0, device=dev)  # takes the prefetch output's block
    device_knobs.synchronize(0)  # the copy back ran, wherever it wrote
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    del host


@on_test_accelerator
def test_reset_under_another_stream_orders_the_streams_transfers_started_on(swaptest_held,
                                                                         monkeypatch):
    """The host cache has nothing to give back here, so ``reset()`` waits for no copy on the host
    (freeing cached pinned blocks would)."""
    dev = swaptest_held
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: None)
    x = torch.arange(float(N), device=dev).view(64, 64)
    host = OPS.swap_out(x)
    user = torch.Stream(device=dev)
    with user:
        swap_pass.reset()
    del x
    later = torch.full((N,), 7.0, device=dev)  # takes x's block
    device_knobs.synchronize(0)
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    del host


# --- graph capture ----------------------------------------------------------------------------


@pytest.fixture
def capturing(swaptest, monkeypatch):
    """``capturing(True)`` makes the test accelerator's device module say its current stream
    captures a graph (``is_current_stream_capturing``), as torch_npu's does inside an NPU graph
    capture; no CPU build can capture."""
    state = {"on": False}
    monkeypatch.setattr(getattr(torch, device_knobs.DEVICE_TYPE), "is_current_stream_capturing",
                        lambda: state["on"], raising=False)
    yield lambda on: state.update(on=on)
    state["on"] = False
    swap_pass.reset()


@on_test_accelerator
def test_swap_out_during_capture_is_refused_and_leaves_nothing(swaptest, capturing):
    x = torch.randn(16, 16, device=swaptest)
    capturing(True)
    with pytest.raises(RuntimeError, match=r"swap_pass\.swap_out: .*capturing"):
        OPS.swap_out(x)
    assert ops.pending_transfers() == 0
    assert swap_pass.swap_stats().host_bytes_in_use == 0


@pytest.mark.parametrize("op", ["prefetch", "swap_in"])
@on_test_accelerator
def test_restore_during_capture_is_refused_and_leaves_the_host_copy(swaptest, capturing, op):
    x = torch.randn(16, 16, device=swaptest)
    host = OPS.wait(OPS.swap_out(x), x)
    capturing(True)
    with pytest.raises(RuntimeError, match=rf"swap_pass\.{op}: .*capturing"):
        getattr(OPS, op).default(host, x.device, [], [])
    capturing(False)
    dev = OPS.swap_in(host, x.device, [], [])  # the host copy is still there
    assert torch.equal(dev.cpu(), x.cpu())


@on_test_accelerator
def test_wait_for_a_pending_copy_during_capture_is_refused(swaptest, capturing):
    x = torch.randn(16, 16, device=swaptest)
    host = OPS.swap_out(x)
    capturing(True)
    with pytest.raises(RuntimeError, match=r"swap_pass\.wait: .*capturing"):
        OPS.wait(host, x)
    capturing(False)
    assert torch.equal(OPS.wait(host, x), x.cpu())


# --- SwapConfig.pin_memory --------------------------------------------------------------------


def test_compiled_graph_passes_pin_memory_to_swap_out():
    torch.manual_seed(0)
    backend = make_swap_backend("aot_eager", config=SwapConfig(pin_memory=False))
    _train(_Stack(), backend, torch.randn(2, 8, 8, 8))
    nodes = [n for n in backend.partitions[-1].forward.graph.nodes
             if n.target is OPS.swap_out.default]
    assert nodes and all(n.args[3] is False for n in nodes)
    torch._dynamo.reset()


def test_swap_out_asks_for_pinned_host_memory_only_when_told(monkeypatch):
    """CPU streams made to say their device pins: a CPU build cannot pin, so asking fails."""
    monkeypatch.setattr(device_streams(torch.device("cpu")), "pin_memory", True)
    x = torch.randn(16, 16)
    host = OPS.swap_out(x, -1, True, False)
    assert not host.is_pinned() and torch.equal(OPS.wait(host, x), x)
    with pytest.raises(swap_pass.HostMemoryError, match="pinned"):
        OPS.swap_out(x)
    del host
    swap_pass.reset()
