"""The CPU stream model queues side-stream copies, poisons what they write, and catches a lost
wait."""

from __future__ import annotations

import pytest
import torch

from swap_pass.runtime.device import device_streams
from swap_pass.runtime.host_pool import host_pool
from swap_pass.testing import ModelEvent, stream_model
from tests.runtime.test_autograd_exact import _loss_and_grads

pytestmark = pytest.mark.no_stream_model  # each test runs its own model


def _exact(seed: int, races: list[str] | None = None) -> bool:
    """Whether a swapped step is bitwise exact under the model; its races go to ``races``."""
    ref_loss, ref_grads = _loss_and_grads(False, "cpu")
    with stream_model(seed=seed, early_probability=0.0, check=races is None) as model:
        loss, grads = _loss_and_grads(True, "cpu")
    if races is not None:
        races.extend(model.races)
    return torch.equal(loss, ref_loss) and all(
        torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_copy_is_queued_and_destination_poisoned_until_waited_for():
    src = torch.arange(6, dtype=torch.float32)
    dst = torch.zeros(6)
    with stream_model(early_probability=0.0) as model:
        ds = device_streams("cpu")
        assert ds.is_async and not ds.pin_memory
        ds.copy(ds.h2d_stream(), dst, src)
        event = ds.record_event(ds.h2d_stream())
        assert torch.isnan(dst).all() and model.pending() == 1 and not event.query()
        ds.wait(ds.compute_stream(), event)
        assert torch.equal(dst, src) and model.pending() == 0 and event.query()


def test_integer_destinations_are_poisoned_with_all_ones_bytes():
    dst, src = torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    with stream_model(early_probability=0.0, check=False):  # nobody waits: a race by design
        ds = device_streams("cpu")
        ds.copy(ds.d2h_stream(), dst, src)
        assert (dst == -1).all()
    assert (dst == 1).all()  # leaving the model completes every copy


def test_copies_complete_early_at_seeded_points_the_same_way_each_run():
    def early_runs(seed: int) -> list[int]:
        with stream_model(seed=seed, early_probability=0.5, check=False) as model:
            ds, seen = device_streams("cpu"), []
            for _ in range(20):
                ds.copy(ds.d2h_stream(), torch.empty(4), torch.ones(4))
                seen.append(model.copies_run_early)
        return seen

    assert early_runs(1) == early_runs(1)
    assert early_runs(1)[-1] > 0


def test_side_stream_copies_on_the_compute_stream_run_at_once():
    dst = torch.zeros(3)
    with stream_model(early_probability=0.0) as model:
        ds = device_streams("cpu", use_streams=False)
        ds.copy(ds.d2h_stream(), dst, torch.ones(3))
        assert torch.equal(dst, torch.ones(3)) and model.copies_queued == 0


def test_freed_storage_is_poisoned_and_a_late_copy_is_a_hazard():
    src = torch.ones(8)
    with stream_model(early_probability=0.0, check=False) as model:
        ds = device_streams("cpu")
        host = torch.empty(8)
        ds.copy(ds.d2h_stream(), host, src)
        ds.free_storage(src.untyped_storage())  # no wait: the copy has not run
        model.synchronize()
    assert torch.isnan(host).all()
    assert model.hazards and "source storage was freed" in model.hazards[0]


def test_released_host_buffer_is_poisoned_after_its_last_copy():
    with stream_model(early_probability=0.0) as model:
        buf = host_pool().acquire(16, pin=False)
        buf.fill_(7)
        ds, dev = device_streams("cpu"), torch.empty(16, dtype=torch.uint8)
        ds.copy(ds.h2d_stream(), dev, buf)
        host_pool().release(buf)  # the H2D still reads it
        assert (buf == 7).all()
        model.synchronize()
    assert (dev == 7).all() and (buf == 0xFF).all()


def test_models_do_not_nest_and_probability_is_checked():
    with stream_model(), pytest.raises(RuntimeError, match="already active"):
        with stream_model():
            pass
    with pytest.raises(ValueError, match="early_probability=2"):
        with stream_model(early_probability=2):
            pass


def test_exactness_holds_under_the_model_for_many_seeds():
    assert all(_exact(seed) for seed in range(5))


@pytest.mark.parametrize("side", ["h2d", "d2h"])
def test_deleting_one_wait_makes_the_exactness_test_fail(monkeypatch, side):
    """The model can fail: without the compute stream's wait on one copy, gradients are poison."""
    assert _exact(0)
    with stream_model():
        modelled = type(device_streams("cpu"))
    wait = modelled.wait

    def wait_without_one(stream, event):
        if isinstance(event, ModelEvent) and event.stream.name == side and stream.is_compute:
            return  # the mutation: the compute stream no longer waits for this copy
        wait(stream, event)

    monkeypatch.setattr(modelled, "wait", staticmethod(wait_without_one))
    races: list[str] = []
    assert not _exact(0, races)
    assert any(f"on the {side} stream" in r for r in races), races  # the checker names the copy
