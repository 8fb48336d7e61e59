"""SwapTensors: state machine, bitwise round trips, storage really freed, buffers pooled."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig, SwapStateError, SwapTensors, is_valid_for_swap
from swap_pass.runtime import host_pool
from swap_pass.runtime.device import is_async_device
from swap_pass.runtime.freeing import _guards, is_guarded
from swap_pass.runtime.host_pool import block_bytes

STATES = ["device", "d2h", "host", "h2d"]
TRANSITIONS = {  # method -> the only state it may be called in
    "swap_to_host": "device",
    "wait_d2h": "d2h",
    "swap_to_device": "host",
    "wait_h2d": "h2d",
}
ORDER = ["swap_to_host", "wait_d2h", "swap_to_device", "wait_h2d"]


def _group_in_state(state: str, device: torch.device) -> SwapTensors:
    group = SwapTensors([torch.randn(8, 8, device=device)])
    for method in ORDER[: STATES.index(state)]:
        getattr(group, method)()
    assert group.stat == state
    return group


def _round_trip(group: SwapTensors) -> None:
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("method", ORDER)
def test_every_transition_legal_only_in_its_state(method: str, state: str, device) -> None:
    group = _group_in_state(state, device)
    if TRANSITIONS[method] == state:
        getattr(group, method)()
        assert group.stat == STATES[(STATES.index(state) + 1) % 4]
    else:
        with pytest.raises(SwapStateError) as err:
            getattr(group, method)()
        assert repr(state) in str(err.value) and repr(TRANSITIONS[method]) in str(err.value)
        assert group.stat == state


def _cases(device):
    base = torch.arange(64 * 3, dtype=torch.float32, device=device).reshape(64, 3)
    return {
        "contiguous": [torch.randn(16, 32, device=device)],
        "transposed": [torch.randn(16, 32, device=device).t()],
        "slice": [base[10:20, 1:]],
        "two_views": [base[:8], base.view(-1)[5:50]],
        "zero_dim": [torch.tensor(3.25, device=device)],
        "bf16": [torch.randn(7, 5, device=device).to(torch.bfloat16)],
        "fp16": [torch.randn(7, 5, device=device).to(torch.float16)],
        "fp32_offset": [torch.randn(100, device=device)[37:]],
        "int64": [torch.randint(-(2**40), 2**40, (33,), device=device)],
    }


@pytest.mark.parametrize("case", list(_cases("cpu")))
def test_round_trip_bitwise(case: str, device, use_streams) -> None:
    tensors = _cases(device)[case]
    before = [(t.clone(), t.stride(), t.storage_offset(), t.dtype) for t in tensors]
    group = SwapTensors(tensors, config=SwapConfig(use_streams=use_streams))
    group.swap_to_host()
    group.wait_d2h()
    for t in tensors:
        assert t.untyped_storage().nbytes() == 0, "device storage must be freed after wait_d2h"
    group.swap_to_device()
    group.wait_h2d()
    for t, (ref, stride, offset, dtype) in zip(tensors, before, strict=True):
        assert torch.equal(t, ref)
        assert (t.stride(), t.storage_offset(), t.dtype) == (stride, offset, dtype)


def test_shared_storage_swapped_once_whole(device) -> None:
    base = torch.randn(10, 10, device=device)
    a, b = base[2:4], base[:, 3]
    group = SwapTensors([a, b, base])
    assert group.nbytes == base.untyped_storage().nbytes() == 400
    group.swap_to_host()
    assert swap_pass.swap_stats().swapped_out_bytes == 400


def test_host_buffer_back_in_pool_after_wait_h2d(device) -> None:
    t = torch.randn(32, 32, device=device)
    group = SwapTensors([t])
    group.swap_to_host()
    assert swap_pass.swap_stats().host_bytes_in_use == t.nbytes
    group.wait_d2h()
    group.swap_to_device()
    assert swap_pass.swap_stats().host_bytes_in_use == t.nbytes
    group.wait_h2d()
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    assert host_pool().bytes_reserved == t.nbytes  # cached, ready for reuse


def test_pool_reuses_buffers_across_steps(device) -> None:
    tensors = [torch.randn(n, n, device=device) for n in (64, 32, 16)]
    _round_trip(SwapTensors(tensors[:2]))
    _round_trip(SwapTensors(tensors[2:]))
    allocs = swap_pass.swap_stats().host_allocations
    for _ in range(3):  # later steps of the same shapes allocate nothing new
        _round_trip(SwapTensors(tensors[:2]))
        _round_trip(SwapTensors(tensors[2:]))
    assert swap_pass.swap_stats().host_allocations == allocs == 3


def test_parameters_and_their_views_refused(device) -> None:
    p = torch.nn.Parameter(torch.randn(4, 4, device=device))
    assert not is_valid_for_swap(p)
    assert not is_valid_for_swap(p[1:])
    assert not is_valid_for_swap(p.view(-1))
    assert not is_valid_for_swap("not a tensor")
    assert not is_valid_for_swap(torch.empty(0, device=device))
    assert is_valid_for_swap(torch.randn(3, device=device))
    group = SwapTensors([p, p[1:], torch.randn(2, device=device)])
    group.swap_to_host()
    group.wait_d2h()
    assert p.untyped_storage().nbytes() == 64, "a Parameter must keep its storage"


def test_freed_storage_is_not_valid_again(device) -> None:
    t = torch.randn(4, device=device)
    group = SwapTensors([t])
    group.swap_to_host()
    group.wait_d2h()
    assert not is_valid_for_swap(t)


def test_custom_check_fn_respected(device) -> None:
    big, small = torch.randn(100, device=device), torch.randn(3, device=device)
    group = SwapTensors([big, small], custom_check_fn=lambda t: t.numel() > 10)
    group.swap_to_host()
    group.wait_d2h()
    assert big.untyped_storage().nbytes() == 0
    assert small.untyped_storage().nbytes() == 12
    assert is_valid_for_swap(small) and not is_valid_for_swap(small, lambda t: False)


def test_min_swap_bytes_keeps_small_storages(device) -> None:
    big, small = torch.randn(100, device=device), torch.randn(3, device=device)
    group = SwapTensors([big, small], config=SwapConfig(min_swap_bytes=64))
    group.swap_to_host()
    group.wait_d2h()
    assert big.untyped_storage().nbytes() == 0 and small.untyped_storage().nbytes() == 12


def test_stats_count_bytes_both_ways(device) -> None:
    t = torch.randn(10, 10, device=device)
    _round_trip(SwapTensors([t]))
    s = swap_pass.swap_stats()
    assert (s.swap_outs, s.swap_ins, s.swapped_out_bytes, s.swapped_in_bytes) == (1, 1, 400, 400)
    # Host memory in the bytes the host allocator sets aside: a pinned block is a power of two.
    assert s.peak_host_bytes_in_use == block_bytes(400, is_async_device(device))
    assert s.host_bytes_in_use == 0
    assert s.peak_device_bytes_released == 400 and s.device_bytes_released == 0


def test_restore_from_every_state_keeps_data(device) -> None:
    for state in STATES:
        group = _group_in_state(state, device)
        ref = None if state in ("host", "h2d") else group.tensors[0].clone()
        group.restore()
        assert group.stat == "device"
        assert group.tensors[0].untyped_storage().nbytes() == 256
        if ref is not None:
            assert torch.equal(group.tensors[0], ref)
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def test_restore_after_host_is_bitwise(device) -> None:
    t = torch.randn(5, 5, device=device)
    ref = t.clone()
    group = SwapTensors([t])
    group.swap_to_host()
    group.wait_d2h()
    group.restore()
    assert torch.equal(t, ref)


def test_discard_releases_host_bytes(device) -> None:
    for state in STATES:
        group = _group_in_state(state, device)
        group.discard()
        assert group.stat == "device" and group.is_empty
    s = swap_pass.swap_stats()
    assert s.host_bytes_in_use == 0 and s.device_bytes_released == 0


def test_assert_on_device_catches_early_reader(device) -> None:
    group = _group_in_state("h2d", device)
    with pytest.raises(SwapStateError, match="'h2d'"):
        group.assert_on_device("layer 3 recompute")
    group.wait_h2d()
    group.assert_on_device("layer 3 recompute")


def test_meta_tensors_are_left_out_of_a_group() -> None:
    a = torch.randn(2)
    b = torch.randn(2, device="meta")
    group = SwapTensors([a, b])  # meta tensors hold no data: only the CPU tensor is swapped
    assert group.device == torch.device("cpu")
    assert len(group.tensors) == 1 and group.tensors[0] is a


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*are deprecated:UserWarning")
def test_quantized_tensor_round_trips_bitwise(device) -> None:
    if device.type != "cpu":
        pytest.skip("quantized tensors are CPU tensors here")
    q = torch.quantize_per_tensor(torch.randn(4, 8), 0.1, 3, torch.qint8)
    expected = q.int_repr().clone()
    group = SwapTensors([q])
    group.swap_to_host()
    group.wait_d2h()
    assert q.untyped_storage().nbytes() == 0, "the storage must really be freed"
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(q.int_repr(), expected)
    assert (q.q_scale(), q.q_zero_point(), q.dtype) == (0.1, 3, torch.qint8)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype:UserWarning")
def test_nested_tensors_are_left_out_of_a_group() -> None:
    nested = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
    jagged = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)],
                                        layout=torch.jagged)
    plain = torch.randn(4)
    before = [t.clone() for t in nested.unbind()]
    assert not is_valid_for_swap(nested) and not is_valid_for_swap(jagged)
    group = SwapTensors([nested, jagged, plain])
    assert len(group.tensors) == 1 and group.tensors[0] is plain
    group.swap_to_host()
    group.wait_d2h()
    assert plain.untyped_storage().nbytes() == 0, "the plain tensor must really be swapped out"
    group.swap_to_device()
    group.wait_h2d()
    assert all(torch.equal(a, b) for a, b in zip(nested.unbind(), before, strict=True))


@pytest.mark.unordered_on_purpose  # the write races the copy out on a device
def test_in_place_write_during_d2h_detected(device) -> None:
    t = torch.randn(4, device=device)
    group = SwapTensors([t], name="layers.3")
    group.swap_to_host()
    t.add_(1)
    with pytest.raises(swap_pass.SwapDataError, match="layers.3"):
        group.wait_d2h()


def test_freed_tensors_are_guarded_from_wait_d2h_to_wait_h2d(device) -> None:
    # Only calls that cannot touch freed data run here; data reads and writes of guarded
    # tensors are in tests/reliability/test_freed_guard.py, in child processes.
    base = torch.randn(64, device=device)
    view = base[8:]
    small = torch.randn(4, device=device)  # below min_swap_bytes: never freed, never guarded
    group = SwapTensors([base, view, small], name="layers[3]", config=SwapConfig(min_swap_bytes=64))
    group.swap_to_host()
    assert not is_guarded(base), "data is still on the device while the copy runs"
    group.wait_d2h()
    assert is_guarded(base) and is_guarded(view) and not is_guarded(small)
    assert (base.shape, view.storage_offset(), base._version, base.untyped_storage().nbytes()) == (
        (64,), 8, 0, 0)
    assert repr(base) == (f"tensor(<swapped out by swap_pass: layers[3]>, size=(64,), "
                          f"dtype=torch.float32, device='{torch.empty(0, device=device).device}')")
    with pytest.raises(swap_pass.SwapDataError,
                       match=r"Tensor\.data \(get\) was called on a tensor of layers\[3\]"):
        _ = base.data  # an alias over the freed storage would crash its first reader
    group.swap_to_device()
    assert is_guarded(base), "the copy back may still be writing the storage"
    group.wait_h2d()
    assert type(base) is torch.Tensor and type(view) is torch.Tensor
    assert not hasattr(base, "_swap_pass_swapped_out")


def test_reading_a_tensor_in_flight_back_waits_for_its_copy(device) -> None:
    x = torch.randn(64, device=device)
    expected = x.clone()
    group = SwapTensors([x, x[8:]])
    group.swap_to_host()
    group.wait_d2h()
    group.swap_to_device()
    assert torch.equal(x * 1, expected * 1)  # the reader completed the restore first
    assert group.stat == "device" and not is_guarded(x)


def test_discarded_host_group_stays_guarded(device) -> None:
    t = torch.randn(64, device=device)
    group = SwapTensors([t], name="model.layers[3]")
    group.swap_to_host()
    group.wait_d2h()
    group.discard()  # nobody will restore it: its storage stays freed, so it stays guarded
    assert is_guarded(t) and t.untyped_storage().nbytes() == 0
    del group  # the error still names where the data went
    with pytest.raises(swap_pass.SwapDataError, match=r"a tensor of model\.layers\[3\]"):
        t + 1


def test_a_guard_leaves_no_trace_on_the_tensor_or_behind_it(device) -> None:
    t = torch.randn(64, device=device)
    group = SwapTensors([t], name="layer")
    group.swap_to_host()
    group.wait_d2h()
    assert is_guarded(t) and _guards[id(t)]() is group and t.untyped_storage().nbytes() == 0
    assert vars(t) == {}  # nothing is set on the tensor itself
    group.restore()
    assert not is_guarded(t) and id(t) not in _guards
    group = SwapTensors([t])
    group.swap_to_host()
    group.wait_d2h()
    group.discard()
    key = id(t)
    assert key in _guards
    del t  # a tensor given up takes its entry with it
    assert key not in _guards


def test_kept_on_device_is_never_guarded(device) -> None:
    kept = torch.randn(64, device=device)
    cfg = SwapConfig(max_host_bytes=0, on_host_exhausted="keep_on_device")
    with pytest.warns(RuntimeWarning, match="keep_on_device"):
        group = SwapTensors([kept], config=cfg)
        group.swap_to_host()
    group.wait_d2h()
    assert group.kept_on_device and not is_guarded(kept) and torch.equal(kept, kept.clone())


@pytest.mark.parametrize("state", ["d2h", "host", "h2d"])
def test_dropped_group_gives_host_bytes_back(state: str, device) -> None:
    import gc

    group = _group_in_state(state, device)
    group.cycle = group  # only the cycle collector can free it, at any later allocation
    del group
    gc.collect()
    s = swap_pass.swap_stats()
    assert s.host_bytes_in_use == 0 and s.device_bytes_released == 0
    for _ in range(50):  # finalizers running inside pool/stats updates must not deadlock
        g = _group_in_state("host", device)
        g.cycle = g
        del g
    gc.collect()
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def test_dense_tensor_copies_tensor_to_tensor_without_autograd_or_version_bumps(device) -> None:
    # See Note: [Dense copies] in swap_pass/runtime/group.py.
    leaf = torch.randn(4, 6, 8, device=device, requires_grad=True)
    t = leaf.tanh()  # tanh saves its output: autograd checks t's version when it unpacks it
    ref, version = t.detach().clone(), t._version
    group = SwapTensors([t])
    group.swap_to_host()
    host = group._entries[0].host
    assert (host.dtype, host.shape, host.requires_grad, host.grad_fn) == (
        t.dtype, t.shape, False, None)
    group.wait_d2h()
    assert t.untyped_storage().nbytes() == 0
    group.swap_to_device()
    group.wait_h2d()
    assert torch.equal(t, ref) and t._version == version
    t.sum().backward()  # would raise "modified by an inplace operation" after a version bump
    expected = leaf.detach().clone().requires_grad_()
    expected.tanh().sum().backward()
    assert torch.equal(leaf.grad, expected.grad)


def test_views_still_copy_whole_storages(device) -> None:
    base = torch.randn(10, 10, device=device)
    view = base[2:5]
    group = SwapTensors([view])
    assert not group._entries[0].dense
    group.swap_to_host()
    assert group._entries[0].host.shape == (400,) and group._entries[0].host.dtype == torch.uint8


def test_runtime_copies_are_named_in_the_profiler(device) -> None:
    from torch.profiler import ProfilerActivity, profile

    t = torch.randn(16, 16, device=device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _round_trip(SwapTensors([t]))
    names = [e.name() for e in prof.profiler.kineto_results.events()]
    assert names.count("swap_pass::copy[1024 B]") == 2  # one each way
