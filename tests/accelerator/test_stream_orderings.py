"""Each stream ordering the runtime keeps, in an interleaving that needs it, on the test
accelerator: exact (and no unordered read or free counted) with the ordering; deleting it
(``scripts/stream_mutations.py --device``) gives wrong numbers or an unordered free.

Most use ``long_delay``: a side-stream copy runs only once someone waits for it, so the order in
which copies run is the order of the waits, the same in every run.
"""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.testing import accelerator as device_knobs

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

N = 16 * 1024
ops = torch.ops.swap_pass


def _counter(name: str, device: int = 0) -> int:
    return device_knobs.memory_stats(device).get(name, 0)


@pytest.fixture
def unordered():
    """Fails the test when the device counted a read, a write or a free out of order during it
    (on either device)."""
    before = device_knobs.order_counters()
    yield
    device_knobs.synchronize()
    after = device_knobs.order_counters()
    assert after == before, f"the device counted accesses out of order: {before} -> {after}"


def _produced(dev: torch.device) -> torch.Tensor:
    """A tensor just computed on the compute stream: the host never waited for it."""
    return torch.arange(float(N), device=dev) * 3


def _expected() -> torch.Tensor:
    return torch.arange(float(N)) * 3


# --- the copies wait for their producer ---------------------------------------------------------


def test_a_swap_tensors_round_trip_of_data_just_produced_is_exact(dev, unordered) -> None:
    """The copy out reads what compute wrote only after the d2h stream waited on the compute
    stream: without that wait the device's order check gives it poison."""
    x = _produced(dev)
    group = SwapTensors([x])
    group.swap_to_host()
    group.wait_d2h()
    assert x.untyped_storage().nbytes() == 0
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(x.cpu(), _expected())
    swap_pass.reset()


def test_a_graph_ops_round_trip_of_data_just_produced_is_exact(dev, unordered) -> None:
    x = _produced(dev)
    host = ops.wait(ops.swap_out(x), x)
    del x
    out = ops.prefetch(host, dev, [], [])
    out = ops.wait(out, host)
    assert torch.equal(out.cpu(), _expected())
    swap_pass.reset()


# --- a host buffer goes back to the pool with its last copy's event ------------------------------


def test_a_buffer_released_by_wait_h2d_is_rewritten_on_another_device_only_after_it_was_read(
        long_delay, unordered) -> None:
    """Device 0's copy back still reads the buffer when ``wait_h2d`` gives it back (the compute
    stream waited, the host did not); device 1's copy out takes it and must wait for that read."""
    dev0, dev1 = long_delay, torch.device(device_knobs.DEVICE_TYPE, 1)
    x0 = _produced(dev0)
    group0 = SwapTensors([x0])
    group0.swap_to_host()
    group0.wait_d2h()
    device_knobs.synchronize(0)  # the copy out ran: the buffer holds x0
    group0.swap_to_device()
    group0.wait_h2d()  # the copy back is still queued: nobody waited on the host
    x1 = torch.full((N,), 7.0, device=dev1)
    fresh = device_knobs.pinned_stats()["fresh_blocks"]
    group1 = SwapTensors([x1])
    group1.swap_to_host()
    assert device_knobs.pinned_stats()["fresh_blocks"] == fresh  # it took device 0's buffer
    device_knobs.synchronize(1)  # device 1's copy out runs, after what its stream waits for
    assert torch.equal(x0.cpu(), _expected())
    group1.wait_d2h()
    group1.swap_to_device()
    group1.wait_h2d()
    assert torch.equal(x1.cpu(), torch.full((N,), 7.0))
    swap_pass.reset()


# --- a copy out abandoned is waited for before its source can be reused --------------------------


def test_a_copy_out_abandoned_by_restore_is_ordered_before_its_source_is_freed(
        long_delay, unordered) -> None:
    """``restore()`` from "d2h" keeps the data on the device while the copy out may still read
    it; the source may die at once, and its block go to the compute stream's next allocation."""
    dev = long_delay
    x = _produced(dev)
    group = SwapTensors([x])
    group.swap_to_host()
    group.restore()
    assert group.stat == "device" and torch.equal(x.cpu(), _expected())
    frees = _counter("unordered_frees")
    del x, group  # the block goes back to the compute stream's pool
    # Nobody reads the abandoned copy's bytes: a free before it is seen as the free itself (on a
    # device the copy would read the next tensor's data, or fault on an unmapped block).
    assert _counter("unordered_frees") == frees
    later = torch.full((N,), 7.0, device=dev)
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    swap_pass.reset()


# --- a graph op's tensor dying before its wait --------------------------------------------------


def test_a_swapped_out_tensor_dying_before_its_wait_keeps_its_host_copy_exact(
        long_delay, unordered) -> None:
    """An aborted forward drops the source of a ``swap_out`` before its ``wait``: its block goes
    to the compute stream's next allocation, which must come after the copy out read it."""
    dev = long_delay
    x = _produced(dev)
    torch.accelerator.synchronize(dev)
    host = ops.swap_out(x)
    del x
    later = torch.full((N,), 7.0, device=dev)  # takes the source's block
    host = ops.wait(host)
    torch.accelerator.synchronize(dev)  # the host reads the host copy
    assert torch.equal(host, _expected())
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    swap_pass.reset()


def test_a_prefetched_tensor_dying_before_its_wait_is_not_overwritten_by_its_copy(
        long_delay, unordered) -> None:
    """A backward aborted between ``prefetch`` and its ``wait`` drops the destination: the copy
    back still writes its block, which the compute stream's next allocation takes."""
    dev = long_delay
    x = _produced(dev)
    host = ops.wait(ops.swap_out(x), x)
    del x
    out = ops.prefetch(host, dev, [], [])
    del out
    later = torch.full((N,), 7.0, device=dev)  # takes the destination's block
    assert torch.equal(later.cpu(), torch.full((N,), 7.0))
    swap_pass.reset()


# --- the compute stream of a swap is the one current at the layer's entry ------------------------


class _LeavesAStreamCurrent(torch.nn.Module):
    """A block whose forward computes on the stream current at its entry and leaves another one
    current (as code that switches streams without restoring them does). ``writes_input``: it
    first scales its input in place, so the copy out begun at its entry is stale and the input is
    copied again after the forward, with the other stream current."""

    def __init__(self, side: torch.Stream, writes_input: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.side = side
        self.writes_input = writes_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.writes_input:
            x.mul_(2.0)
        y = torch.sin(self.linear(x))  # saves its input, not y, which the next block may write
        torch.accelerator.set_stream(self.side)
        return y


class _Stack(torch.nn.Module):
    def __init__(self, side: torch.Stream, layers: int = 4, writes_input: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_LeavesAStreamCurrent(side, writes_input)
                                          for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.accelerator.current_stream(x.device)
        for layer in self.layers:
            torch.accelerator.set_stream(compute)
            x = layer(x)
        torch.accelerator.set_stream(compute)
        return (x * x).sum()


def _train_step(model: torch.nn.Module, x: torch.Tensor):
    loss = model(x)
    loss.backward()
    return loss.cpu(), [p.grad.cpu() for p in model.parameters()]


def _leaves_a_stream_current(dev: torch.device, writes_input: bool) -> None:
    compute = torch.accelerator.current_stream(dev)
    side = torch.Stream(device=dev)
    torch.manual_seed(0)
    ref = _Stack(side, writes_input=writes_input).to(dev)
    model = _Stack(side, writes_input=writes_input).to(dev)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(512, 64, device=dev)
    expected = _train_step(ref, x.clone())  # a block that writes its input writes x too
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers)
    got = _train_step(model, x.clone())
    assert torch.accelerator.current_stream(dev) == compute
    assert swap_pass.swap_stats().peak_device_bytes_released > 0
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1], strict=True))
    handle.remove()
    swap_pass.reset()


def test_a_layer_leaving_another_stream_current_swaps_on_its_entry_stream(dev, unordered):
    """The layer input was made on the stream current at the layer's entry and its block belongs
    to that stream's pool: its swap, begun at the entry, waits for its producer, and orders its
    free and its copy back, there, though the layer leaves another stream current."""
    _leaves_a_stream_current(dev, writes_input=False)


@pytest.mark.unordered_on_purpose
def test_an_input_written_by_such_a_layer_is_copied_again_on_its_entry_stream(dev):
    """The layer writes its input in place: the copy out begun at its entry is stale, and the
    input is copied again after the forward, with another stream current; that copy must still
    order on the entry stream (Note: [The copy out starts at the layer's entry]). The write races
    the stale copy, whose bytes are thrown away: counted as unordered writes, nothing else."""
    before = device_knobs.order_counters()
    _leaves_a_stream_current(dev, writes_input=True)
    device_knobs.synchronize()
    after = device_knobs.order_counters()
    assert after["unordered_reads"] == before["unordered_reads"]
    assert after["unordered_frees"] == before["unordered_frees"]
