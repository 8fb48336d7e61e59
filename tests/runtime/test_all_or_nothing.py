"""Every transition of a group is all or nothing: a failure on one storage (a free the device
refuses, a copy error, no host buffer, no device memory for the copy back) leaves every tensor of
the group with its data, and no abort or reset path drops a freed storage's host copy.

See Note: [All-or-nothing transitions] in ``swap_pass/runtime/group.py``. Each test of a
group runs on every device present (``device``): on the test accelerator (in its pass) an undo
path's missing or misplaced wait reads poison, or is counted as an unordered read, write or free
and fails the test at teardown (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig, SwapDataError, SwapTensors, swap_stats
from swap_pass.runtime.device import register_free_check
from swap_pass.runtime.freeing import is_guarded
from swap_pass.runtime.host_pool import host_pool
from swap_pass.testing import InjectedFailure, inject_failures


def _two_storages(device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tensors = [torch.randn(64, 32, device=device), torch.randn(128, device=device)]
    return tensors, [t.clone() for t in tensors]


def _all_there(tensors: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(not is_guarded(t) and t.untyped_storage().nbytes() == t.nbytes
               and torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


@pytest.fixture(params=[True, False], ids=["streams", "no_streams"])
def config(request) -> SwapConfig:
    return SwapConfig(use_streams=request.param)


def test_a_free_that_fails_on_the_second_storage_restores_the_first(config, device):
    tensors, expected = _two_storages(device)
    group = SwapTensors(tensors, config=config, name="layers[3]")
    group.swap_to_host()
    with inject_failures(free=2) as injected, pytest.raises(InjectedFailure) as err:
        group.wait_d2h()
    assert injected.fired == ["free"] and injected.calls["free"] == 2
    assert "keeps its data" in "".join(getattr(err.value, "__notes__", []))
    assert group.stat == "device" and _all_there(tensors, expected)
    assert host_pool().bytes_in_use == 0
    swap_pass.reset()  # nothing left to restore, nothing lost
    assert _all_there(tensors, expected)


def test_the_group_swaps_normally_after_a_failed_free(config, device):
    tensors, expected = _two_storages(device)
    group = SwapTensors(tensors, config=config)
    group.swap_to_host()
    with inject_failures(free=1), pytest.raises(InjectedFailure):
        group.wait_d2h()
    group.swap_to_host()
    group.wait_d2h()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    group.swap_to_device()
    group.wait_h2d()
    assert _all_there(tensors, expected)


@pytest.mark.parametrize("kind", ["copy", "host_alloc"])
def test_a_failure_starting_the_copy_out_leaves_the_group_on_the_device(config, device, kind):
    tensors, expected = _two_storages(device)
    group = SwapTensors(tensors, config=config)
    outs_before = swap_stats().swap_outs
    with inject_failures(**{kind: 2}) as injected, pytest.raises(InjectedFailure):
        group.swap_to_host()
    assert injected.fired == [kind]
    assert group.stat == "device" and _all_there(tensors, expected)
    assert host_pool().bytes_in_use == 0 and swap_stats().swap_outs == outs_before
    group.swap_to_host()  # no storage is left claimed by the failed attempt
    group.wait_d2h()
    group.swap_to_device()
    group.wait_h2d()
    assert _all_there(tensors, expected)


@pytest.mark.parametrize("kind", ["allocate", "copy"])
def test_a_failure_of_the_copy_back_keeps_the_data_on_the_host(config, device, kind):
    tensors, expected = _two_storages(device)
    group = SwapTensors(tensors, config=config)
    group.swap_to_host()
    group.wait_d2h()
    with inject_failures(**{kind: 2}) as injected, pytest.raises(InjectedFailure):
        group.swap_to_device()
    assert injected.fired == [kind]
    assert group.stat == "host" and all(is_guarded(t) for t in tensors)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    group.restore()  # device memory is back: the host copies are intact
    assert group.stat == "device" and _all_there(tensors, expected)
    assert host_pool().bytes_in_use == 0


def test_reset_keeps_a_group_it_cannot_restore_and_restores_it_later(config, device):
    tensors, expected = _two_storages(device)
    group = SwapTensors(tensors, config=config, name="layers[5]")
    group.swap_to_host()
    group.wait_d2h()
    with inject_failures(allocate=1), pytest.raises(SwapDataError, match=r"layers\[5\]"):
        swap_pass.reset()
    assert group.stat == "host" and all(is_guarded(t) for t in tensors)  # its host copy held
    swap_pass.reset()  # device memory is back
    assert group.stat == "device"
    assert _all_there(tensors, expected) and host_pool().bytes_in_use == 0


def test_a_kept_group_restored_by_its_reader_is_forgotten(config, device):
    tensors, expected = _two_storages(device)
    group = SwapTensors(tensors, config=config)
    group.swap_to_host()
    group.wait_d2h()
    with inject_failures(allocate=1), pytest.raises(SwapDataError):
        swap_pass.reset()
    group.restore()
    assert _all_there(tensors, expected)
    swap_pass.reset()  # nothing kept any more: no error


def test_inject_failures_rejects_a_call_number_below_one():
    with pytest.raises(ValueError, match="free=0"), inject_failures(free=0):
        pass


def test_a_storage_its_device_cannot_free_is_found_before_the_swap_and_kept():
    """As torch_npu's private formats: the device's check keeps the storage on the device, the
    group swaps the others, and the free is never attempted."""
    tensors, expected = _two_storages(torch.device("cpu"))
    refused = tensors[1].untyped_storage()._cdata
    register_free_check("cpu", lambda t: "private format (test)"
                        if t.untyped_storage()._cdata == refused else None)
    try:
        with pytest.warns(RuntimeWarning, match="private format"):
            group = SwapTensors(tensors, name="layers[2]")
        with inject_failures() as injected:
            group.swap_to_host()
            group.wait_d2h()
        assert injected.calls["free"] == 1  # only the storage the device can free
        assert tensors[0].untyped_storage().nbytes() == 0
        assert torch.equal(tensors[1], expected[1]) and not is_guarded(tensors[1])
        assert swap_stats().skipped_bytes["non_resizable"] == tensors[1].nbytes
        group.restore()
        assert _all_there(tensors, expected)
    finally:
        register_free_check("cpu", None)
