"""End to end: ``SwapConfig.max_host_bytes`` reached while training through
``enable_swap_layer_input``, under both ``on_host_exhausted`` policies.

The cap leaves room for exactly two layer inputs of a ``(2, 8)`` batch, so with four layers the
first two inputs go to the host and the third (layer 2's) finds the cap reached.
"""

from __future__ import annotations

import warnings

import pytest

import swap_pass
from swap_pass import HostMemoryError, SwapConfig, enable_swap_layer_input
from swap_pass.runtime import host_pool
from tests.conftest import ACCELERATOR, HAS_ACCELERATOR, NO_ACCELERATOR_REASON
from tests.eager.helpers import assert_clean, assert_exact, batch, train_step
from tests.reliability.helpers import CFG, SWAPPED_LAYERS, InputProbe, input_bytes, model_pair, sgd

BIG = input_bytes(2, 8)  # 2048: one layer input of the (2, 8) batch
SPARE = 904  # cap headroom that fits no third input, so "available" is a distinctive number
CAP = 2 * BIG + SPARE
RECOMPUTE = pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])


def _capped(model, policy: str):
    return enable_swap_layer_input(
        model, config=SwapConfig(max_host_bytes=CAP, on_host_exhausted=policy))


def _probed_step(ref, model, b) -> list[int]:
    """One SGD step of both models, bitwise compared; returns the swapped model's input bytes
    still resident on the device between its forward and its backward."""
    expected = train_step(ref, b)
    sgd(ref)
    model.zero_grad(set_to_none=True)
    with InputProbe(model) as probe:
        loss = model(*b)
    resident = probe.resident_bytes()
    loss.backward()
    got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    sgd(model)
    assert_exact(expected, got)
    return resident


# --- on_host_exhausted="error" ---------------------------------------------------------------


@RECOMPUTE
def test_error_policy_trains_under_the_cap(recompute, device):
    """Inputs that fit the cap (batch (1, 8): 3 x 1024 bytes) swap and train exactly."""
    ref, model = model_pair(recompute, device=device)
    _capped(model, "error")
    for step in range(2):
        resident = _probed_step(ref, model, batch(CFG, seed=step, b=1, device=device))
        assert resident == [0] * SWAPPED_LAYERS + [input_bytes(1, 8)], step
        assert_clean()
    assert swap_pass.swap_stats().swap_ins == 2 * SWAPPED_LAYERS


@RECOMPUTE
def test_error_policy_raises_with_bytes_and_leaves_nothing(recompute):
    ref, model = model_pair(recompute)
    handle = _capped(model, "error")
    with InputProbe(model) as probe, pytest.raises(HostMemoryError) as err:
        model(*batch(CFG, b=2))
    assert (err.value.needed, err.value.available) == (BIG, SPARE)
    assert str(err.value).startswith(
        f"swap_pass.host_pool: SwapConfig.max_host_bytes={CAP} would be passed: "
        f"{BIG} bytes needed, {SPARE} bytes available.")
    # Layer 0's input had been freed (layer 1 ran) and is back; nothing is held or pending.
    assert len(probe.inputs) == 3 and probe.values_intact()
    assert probe.resident_bytes() == [BIG] * 3
    assert_clean(handle.module_tag)
    assert swap_pass.swap_stats().device_bytes_released == 0
    # Note: [Exceptions inside non-reentrant checkpoint] (docs/reliability.md): torch 2.11's
    # checkpoint leaves its saved-tensor hooks installed while the exception's traceback lives.
    del err
    # The next step, without the cap, swaps every input and is bitwise exact.
    handle.remove()
    enable_swap_layer_input(model)
    assert _probed_step(ref, model, batch(CFG, seed=1)) == [0] * SWAPPED_LAYERS + [BIG]
    assert_clean()


def test_failed_host_allocation_is_a_host_memory_error():
    """A real failed allocation (1 PiB, beyond any address space) reads like the cap."""
    with pytest.raises(HostMemoryError, match=r"swap_pass\.host_pool: allocating a host buffer "
                                              r"failed .*: 1125899906842624 bytes needed"):
        host_pool().take(1 << 50, pin=False)[0]
    assert host_pool().bytes_in_use == 0 and swap_pass.swap_stats().host_allocations == 0


# --- on_host_exhausted="keep_on_device" ------------------------------------------------------


@RECOMPUTE
def test_keep_on_device_warns_once_keeps_overflow_and_is_exact(recompute):
    # swap_pass.reset() (autouse fixture) re-arms the warn-once flag.
    ref, model = model_pair(recompute)
    _capped(model, "keep_on_device")
    steps = 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warn() call, not Python's deduplication
        for step in range(steps):
            # Layers 0 and 1: on the host, device storage freed. Layer 2: kept (cap). 3: last.
            assert _probed_step(ref, model, batch(CFG, seed=step)) == [0, 0, BIG, BIG], step
            assert swap_pass.swap_stats().kept_on_device == step + 1
            assert_clean()
    ours = [w for w in caught if "host memory exhausted" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert "on_host_exhausted='keep_on_device'" in str(ours[0].message)
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == steps * (SWAPPED_LAYERS - 1)
    assert stats.peak_host_bytes_in_use == 2 * BIG <= CAP


# --- pinned blocks (an accelerator only) -----------------------------------------------------


@pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)
def test_the_cap_bounds_pinned_blocks_while_training():
    """Layer inputs of 3,072 bytes pin 4,096-byte blocks (Note: [Pinned block bytes] in
    ``runtime/host_pool.py``): a cap the bytes of three inputs fit (9,300) holds two blocks, so
    the third input stays on the device and the pinned peak stays under the cap."""
    ref, model = (m.to(ACCELERATOR) for m in model_pair(recompute=False))
    enable_swap_layer_input(model, config=SwapConfig(max_host_bytes=9300,
                                                     on_host_exhausted="keep_on_device"))
    b = tuple(t.to(ACCELERATOR) for t in batch(CFG, b=3))
    with pytest.warns(RuntimeWarning, match="keep_on_device"):
        resident = _probed_step(ref, model, b)
    assert resident == [0, 0, input_bytes(3, 8), input_bytes(3, 8)]
    stats = swap_pass.swap_stats()
    assert stats.kept_on_device == 1 and stats.peak_host_bytes_in_use == 2 * 4096
    assert_clean()
