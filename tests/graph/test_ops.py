"""The ``torch.ops.swap_pass.*`` ops: schema/fake checks, make_fx, round trips, runtime hooks."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import swap_pass
from swap_pass import HostMemoryError
from swap_pass.graph import ops
from swap_pass.runtime.freeing import byte_span

OPS = torch.ops.swap_pass


def _inputs():
    """Contiguous, transposed (non-contiguous) and offset-slice activations."""
    base = torch.randn(6, 10)
    return {
        "contiguous": torch.randn(2, 4, 8),
        "transposed": base.t(),
        "offset_slice": base[2:5, 1:7],
    }


def _round_trip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    host = OPS.swap_out(x)
    host = OPS.wait(host, x)
    dev = OPS.prefetch(host, x.device, list(x.shape), list(x.stride()))
    return host, OPS.wait(dev, host)


@pytest.mark.parametrize("kind", list(_inputs()))
def test_opcheck_swap_out(kind):
    x = _inputs()[kind]
    torch.library.opcheck(OPS.swap_out.default, (x,))
    torch.library.opcheck(OPS.swap_out.default, (x, 1 << 20, False))


@pytest.mark.parametrize("kind", list(_inputs()))
@pytest.mark.parametrize("op", ["prefetch", "swap_in"])
def test_opcheck_prefetch_and_swap_in(kind, op):
    x = _inputs()[kind]
    host = ops.empty_host_like(x).copy_(x)  # laid out as swap_out returns it
    torch.library.opcheck(getattr(OPS, op).default,
                          (host, x.device, list(x.shape), list(x.stride())))
    torch.library.opcheck(getattr(OPS, op).default, (x.contiguous(), x.device, [], [], False))


# Note: [wait is not functionalizable]
# ``wait`` returns a view of its input (schema ``Tensor(a) -> Tensor(a)``), like PyTorch's
# ``ao.wait_tensor``. Functionalization rejects custom ops with aliasing outputs, so opcheck's
# ``test_aot_dispatch_dynamic`` cannot pass; the op is only ever inserted into graphs *after*
# AOTAutograd functionalized and partitioned them (aot_pass.py), never traced through it.
WAIT_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("kind", list(_inputs()))
def test_opcheck_wait(kind):
    x = _inputs()[kind]
    host = OPS.swap_out(x)
    torch.library.opcheck(OPS.wait.default, (host, x), test_utils=WAIT_CHECKS)
    torch.library.opcheck(OPS.wait.default, (host,), test_utils=WAIT_CHECKS)
    dev = OPS.prefetch(host, x.device, list(x.shape), list(x.stride()))
    torch.library.opcheck(OPS.wait.default, (dev, host), test_utils=WAIT_CHECKS)


@pytest.mark.parametrize("kind", list(_inputs()))
def test_round_trip_keeps_values_and_layout(kind):
    x = _inputs()[kind]
    host, dev = _round_trip(x)
    # contiguous, or x's own strides over the bytes x spans (Note: [Contiguous copies])
    assert host.device.type == "cpu" and host.stride() == x.stride()
    assert torch.equal(dev, x) and dev.stride() == x.stride()
    stats = swap_pass.swap_stats()
    assert (stats.swap_outs, stats.swap_ins) == (1, 1)
    lo, hi = byte_span([x])
    assert stats.swapped_out_bytes == stats.swapped_in_bytes == hi - lo
    # `host` could still be read (as by a retained graph): its buffer is in use until it dies.
    assert stats.host_bytes_in_use == hi - lo
    del host
    assert swap_pass.swap_stats().host_bytes_in_use == 0 and ops.pending_transfers() == 0


def test_every_op_is_a_node_under_make_fx():
    def f(x):
        host = OPS.wait(OPS.swap_out(x), x)
        dev = OPS.wait(OPS.prefetch(host, x.device, [], []), host)
        return dev + OPS.swap_in(host, x.device, list(x.shape), list(x.stride()))

    x = torch.randn(3, 5)
    gm = make_fx(f)(x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    for op in (OPS.swap_out, OPS.wait, OPS.prefetch, OPS.swap_in):
        assert op.default in targets, op
    assert torch.equal(gm(x), x + x)


def test_wait_survives_dead_code_elimination():
    def f(x):
        host = OPS.swap_out(x)
        OPS.wait(host, x)  # result unused: the side effect must keep it
        return x * 2

    gm = make_fx(f)(torch.randn(4))
    gm.graph.eliminate_dead_code()
    assert OPS.wait.default in [n.target for n in gm.graph.nodes]


def test_host_cap_raises_with_bytes():
    x = torch.randn(64)
    with pytest.raises(HostMemoryError, match=r"swap_pass\.host_pool: .*256 bytes needed"):
        OPS.swap_out(x, 100)
    assert ops.pending_transfers() == 0


def test_host_buffers_are_pooled_between_steps():
    x = torch.randn(32, 8)
    for _ in range(3):
        _round_trip(x)
    assert swap_pass.swap_stats().host_allocations == 1


def test_dropped_host_tensor_returns_its_buffer():
    """A forward without backward: the host copy dies, its buffer goes back, nothing pending."""
    x = torch.randn(16, 16)
    host = OPS.wait(OPS.swap_out(x), x)
    assert swap_pass.swap_stats().host_bytes_in_use == x.numel() * 4
    del host
    gc.collect()
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    assert ops.pending_transfers() == 0


def test_reset_drops_pending_transfers():
    x = torch.randn(8, 8)
    host = OPS.swap_out(x)
    assert ops.pending_transfers() == 2  # the copy and its host buffer
    swap_pass.reset()
    assert ops.pending_transfers() == 0
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    del host
