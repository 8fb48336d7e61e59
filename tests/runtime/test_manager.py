"""SwapLayerInputManager: registration, FIFO pairing of micro-batches, cleanup."""

from __future__ import annotations

import gc

import pytest
import torch

import swap_pass
from swap_pass import SwapLayerInputManager, SwapTensors
from swap_pass.runtime.chain import LayerChain, chain_of_tag


def _free_copied(manager: SwapLayerInputManager) -> None:
    """What the protocol does one layer later: wait for each copy out and free the storage."""
    for group in manager.batch_stack:
        if group.stat == "d2h":
            group.wait_d2h()


def test_registration_order_and_tags() -> None:
    a = [SwapLayerInputManager("enc") for _ in range(3)]
    b = SwapLayerInputManager("dec")
    assert [m.layer_idx for m in a] == [0, 1, 2]
    assert all(m.num_layers == 3 for m in a) and b.num_layers == 1
    assert SwapLayerInputManager.manager_map == {"enc": a, "dec": [b]}
    assert a[2].is_last_layer and not a[0].is_last_layer
    assert a[1].previous is a[0] and a[1].next is a[2] and a[0].previous is None
    a[1].unregister()
    assert [m.layer_idx for m in SwapLayerInputManager.managers("enc")] == [0, 1]


def test_fifo_with_three_micro_batches(device) -> None:
    manager = SwapLayerInputManager()
    inputs = [torch.full((16,), float(mb), device=device) for mb in range(3)]
    groups = [manager.swap_out([x]) for x in inputs]
    _free_copied(manager)
    assert [g.stat for g in manager.batch_stack] == ["host"] * 3
    assert all(x.untyped_storage().nbytes() == 0 for x in inputs)
    for mb in range(3):  # backwards arrive in forward order; each gets its own micro-batch
        manager.batch_stack[0].swap_to_device()
        assert manager.batch_stack[0].stat == "h2d"
        group = manager.wait_swap_in()
        assert group is groups[mb]
        assert torch.equal(inputs[mb], torch.full((16,), float(mb), device=device))
        assert all(x.untyped_storage().nbytes() == 0 for x in inputs[mb + 1:])
    assert manager.batch_stack == []
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def test_wait_swap_in_from_any_state(device) -> None:
    manager = SwapLayerInputManager()
    x = torch.randn(8, device=device)
    ref = x.clone()
    manager.swap_out([x])  # still "d2h": backward came before the free
    manager.wait_swap_in()
    assert torch.equal(x, ref)
    manager.swap_out([x])
    _free_copied(manager)  # "host", never prefetched
    manager.wait_swap_in()
    assert torch.equal(x, ref)


def test_explicit_group_removed_by_identity(device) -> None:
    manager = SwapLayerInputManager()
    xs = [torch.randn(4, device=device) for _ in range(2)]
    g0, g1 = (manager.swap_out([x]) for x in xs)
    _free_copied(manager)
    manager.wait_swap_in(g1)
    assert manager.batch_stack == [g0]


def test_reset_leaves_zero_host_bytes(device) -> None:
    managers = [SwapLayerInputManager() for _ in range(3)]
    for m in managers:
        m.swap_out([torch.randn(64, device=device)])
        _free_copied(m)
    assert swap_pass.swap_stats().host_bytes_in_use == 3 * 256
    swap_pass.reset()
    s = swap_pass.swap_stats()
    assert s.host_bytes_in_use == 0 and s.host_bytes_reserved == 0
    assert SwapLayerInputManager.manager_map == {}
    assert all(m.batch_stack == [] for m in managers)


def test_prefetch_flag_from_config() -> None:
    assert not SwapLayerInputManager(prefetch=False).prefetch_enabled
    assert not SwapLayerInputManager(config=swap_pass.SwapConfig(prefetch=False)).prefetch_enabled
    assert SwapLayerInputManager().prefetch_enabled


def test_empty_group_is_harmless(device) -> None:
    manager = SwapLayerInputManager()
    group = manager.swap_out([torch.nn.Parameter(torch.randn(3, device=device))])
    assert group.is_empty
    _free_copied(manager)
    assert manager.wait_swap_in() is group
    with pytest.raises(swap_pass.SwapStateError):
        group.wait_d2h()


def test_first_layer_preflights_host_memory(monkeypatch) -> None:
    import importlib

    host_pool_module = importlib.import_module("swap_pass.runtime.host_pool")

    managers = [SwapLayerInputManager() for _ in range(4)]
    monkeypatch.setattr(host_pool_module, "available_host_bytes", lambda: 1000)
    x = torch.randn(100)  # 400 bytes; 3 layers hold one each on the host: 1200 > 1000
    with pytest.raises(swap_pass.HostMemoryError, match="1200 bytes needed, 1000 bytes available"):
        managers[0].swap_out([x])
    assert x.untyped_storage().nbytes() == 400
    managers[0].swap_out([torch.randn(50)])  # 600 bytes fit
    keep = SwapLayerInputManager("other", config=swap_pass.SwapConfig(
        on_host_exhausted="keep_on_device"))
    keep.swap_out([torch.randn(1000)])  # no preflight under keep_on_device


def test_reset_rearms_the_keep_on_device_warning() -> None:
    cfg = swap_pass.SwapConfig(max_host_bytes=0, on_host_exhausted="keep_on_device")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="keep_on_device"):
            swap_pass.SwapTensors([torch.randn(4)], config=cfg).swap_to_host()
        swap_pass.reset()


def test_reset_releases_groups_outside_any_manager(device) -> None:
    """A group kept alive by a reference cycle (e.g. a traceback) still gives its host bytes back.

    The cyclic collector runs when it likes; until then the group is alive and its buffer in use,
    so ``reset()`` must reach it directly or the next run starts with host bytes counted.
    """
    gc.disable()
    try:
        for state in ("d2h", "host", "h2d"):
            group = SwapTensors([torch.randn(64, device=device)])
            group.swap_to_host()
            if state != "d2h":
                group.wait_d2h()
            if state == "h2d":
                group.swap_to_device()
            group.cycle = group  # only the cyclic collector could free it
        del group
        assert swap_pass.swap_stats().host_bytes_in_use == 3 * 256
        swap_pass.reset()
        s = swap_pass.swap_stats()
        assert s.host_bytes_in_use == 0 and s.host_bytes_reserved == 0
        assert s.device_bytes_released == 0
    finally:
        gc.enable()
        gc.collect()
    assert swap_pass.swap_stats().host_bytes_in_use == 0, "the finalizer must not release twice"


def test_copies_list_stays_small_when_no_caller_scans_it(device) -> None:
    # FBOverlap swaps out and waits in one call and never asks for earlier layers' copies.
    managers = [SwapLayerInputManager("unscanned") for _ in range(2)]
    t = torch.randn(64, device=device, requires_grad=True) * 1
    for step in range(300):
        group = managers[0].swap_out([t])
        group.wait_d2h()
        if step == 0:
            assert t.untyped_storage().nbytes() == 0  # really swapped out
        managers[0].wait_swap_in(group)
    copying = managers[0].chain.copying
    assert len(copying) <= 65
    assert managers[1].copying_earlier() == [] and copying == []  # a scan drops the rest


def test_manager_map_is_a_read_only_view_of_the_live_chains() -> None:
    chain = LayerChain("owned")  # what a handle holds: one model's managers
    owned = [SwapLayerInputManager(chain=chain) for _ in range(2)]
    tagged = SwapLayerInputManager("by-tag")  # what the decorators build: the chain of its tag
    assert tagged.chain is chain_of_tag("by-tag") and chain.layers == owned
    view = SwapLayerInputManager.manager_map
    assert view == {"owned": owned, "by-tag": [tagged]}
    with pytest.raises(TypeError):
        view["other"] = []
    swap_pass.reset()  # empties every chain; a layer's next call brings its peers back in order
    assert SwapLayerInputManager.manager_map == {} and chain.layers == []
    owned[1].ensure_registered()
    assert chain.layers == owned and [m.layer_idx for m in owned] == [0, 1]
    del owned, chain, view  # nothing else owns that chain: it goes with its managers
    gc.collect()
    assert list(SwapLayerInputManager.manager_map) == []
    tagged.ensure_registered()
    assert SwapLayerInputManager.manager_map == {"by-tag": [tagged]}
