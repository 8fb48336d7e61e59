"""torchtitan's llama3 debug model on CPU: no AC, full AC, selective AC, bitwise against the same
model without swap. ``model.layers`` is an ``nn.ModuleDict``: found by ``enable`` on its own, and
accepted as ``layers=``. ``SwapLayerInputConverter`` through torchtitan's own
``model_registry(..., converters=[...])``: enabled by the first forward, exact, its knobs and
``filter_fqns`` honoured, bad settings refused, ``remove()``.

Needs torchtitan (the ``[torchtitan]`` extra; CI installs it in a separate environment and runs
this directory there). The CPU shims are in ``torchtitan_cpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations import torchtitan_cpu as tc

tc.import_shim()
pytest.importorskip("torchtitan.models.llama3",
                    reason="torchtitan is not installed (pip install 'swap-pass[torchtitan]')")

import dataclasses  # noqa: E402

from torchtitan.models.llama3 import model_registry  # noqa: E402

import swap_pass  # noqa: E402
from swap_pass.integrations.torchtitan import (  # noqa: E402
    SwapLayerInputConverter,
    deferred_swap,
)
from swap_pass.runtime.freeing import in_backward  # noqa: E402
from tests.eager.helpers import assert_clean, assert_exact  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
LAYERS = 4
LAYER_INPUT = tc.BATCH * tc.SEQ * 256 * 4  # [batch, seq, dim] float32


def _freed_after_forward(model, layers, batch):
    """One step; also whether each block's first-forward input was freed when forward ended."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, a: None if in_backward() else seen.append(a[0])) for layer in layers]
    freed: list[bool] = []
    norm_hook = model.norm.register_forward_pre_hook(
        lambda m, a: freed.extend(x.untyped_storage().nbytes() == 0 for x in seen))
    try:
        return tc.train_step(model, batch), freed
    finally:
        norm_hook.remove()
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("ac,explicit", [("none", False), ("full", False), ("selective", False),
                                         ("full", True)],
                         ids=["none", "full", "selective", "full-layers=model.layers"])
def test_llama3_debug_model_bitwise_equal(ac, explicit):
    ref, model = tc.make_llama3_debug(n_layers=LAYERS), tc.make_llama3_debug(n_layers=LAYERS)
    tc.apply_ac(ref, ac)
    tc.apply_ac(model, ac)
    batch = tc.make_batch()
    kept = [t.clone() for t in batch]
    expected = tc.train_step(ref, batch)
    handle = swap_pass.enable_swap_layer_input(model, layers=model.layers if explicit else None)
    assert handle.layers == list(model.layers.values())
    got, freed = _freed_after_forward(model, handle.layers, batch)
    assert freed == [True] * (LAYERS - 1) + [False]
    assert_exact(expected, got)
    assert swap_pass.swap_stats().swap_ins == LAYERS - 1
    assert_clean()
    assert all(torch.equal(a, b) for a, b in zip(kept, batch, strict=True))
    assert_exact(tc.train_step(ref, batch), tc.train_step(model, batch))  # a second step
    handle.remove()
    assert not any("forward" in vars(layer) for layer in model.layers.values())


def test_enable_before_ac_is_exact():
    """Swap enabled on the bare blocks, then torchtitan wraps them in CheckpointWrapper."""
    ref, model = tc.make_llama3_debug(n_layers=LAYERS), tc.make_llama3_debug(n_layers=LAYERS)
    handle = swap_pass.enable_swap_layer_input(model)
    tc.apply_ac(ref, "full")
    tc.apply_ac(model, "full")
    batch = tc.make_batch()
    got, freed = _freed_after_forward(model, handle.layers, batch)
    assert freed == [True] * (LAYERS - 1) + [False]
    assert_exact(tc.train_step(ref, batch), got)
    assert_clean()


# --- switched on by torchtitan's model converter ---------------------------------------------


def _converted(n_layers: int = LAYERS, **knobs):
    """The debug model built from ``model_registry("debugmodel", converters=[
    SwapLayerInputConverter.Config(**knobs)])``."""
    return tc.make_llama3_debug(n_layers=n_layers,
                                converters=[SwapLayerInputConverter.Config(**knobs)])


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_converter_from_model_registry_enables_at_first_forward_bitwise_equal(ac):
    ref, model = tc.make_llama3_debug(n_layers=LAYERS), _converted()
    assert type(model.config).__qualname__ == "SwapLayerInputLlama3ModelConfig"
    tc.apply_ac(ref, ac)
    tc.apply_ac(model, ac)  # after the build, as parallelize_fn does
    deferred = deferred_swap(model)
    assert deferred.handle is None and deferred.layers == []  # armed, not yet enabled
    batch = tc.make_batch()
    expected = tc.train_step(ref, batch)
    got, freed = _freed_after_forward(model, list(model.layers.values()), batch)
    assert deferred.layers == list(model.layers.values())  # the checkpoint wrappers
    assert freed == [True] * (LAYERS - 1) + [False]
    assert_exact(expected, got)
    stats = swap_pass.swap_stats()
    assert stats.swap_ins == LAYERS - 1
    assert stats.swapped_in_bytes == (LAYERS - 1) * LAYER_INPUT
    assert_clean()
    assert_exact(tc.train_step(ref, batch), tc.train_step(model, batch))  # a second step
    deferred.remove()
    assert not any("forward" in vars(layer) for layer in model.layers.values())
    assert not model._forward_pre_hooks and not deferred.active
    with pytest.raises(ValueError, match="has no swap armed"):
        deferred_swap(model)
    swap_pass.reset()
    assert_exact(tc.train_step(ref, batch), tc.train_step(model, batch))
    assert swap_pass.swap_stats().swap_outs == 0  # removed: nothing swapped any more


def test_converter_knobs_reach_the_managers_and_filter_fqns_keeps_blocks():
    knobs = {"prefetch_layers": 2, "max_copies_in_flight": 1, "min_swap_bytes": 16}
    ref = tc.make_llama3_debug(n_layers=LAYERS)
    model = _converted(filter_fqns=["layers.0"], **knobs)
    defaults = SwapLayerInputConverter.Config()
    assert model.config.to_dict()["swap_layer_input"] == {  # what torchtitan logs
        **{f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)},
        **knobs, "filter_fqns": ["layers.0"]}
    batch = tc.make_batch()
    expected = tc.train_step(ref, batch)
    got = tc.train_step(model, batch)
    deferred = deferred_swap(model)
    assert deferred.layers == list(model.layers.values())[1:]
    assert deferred.config == swap_pass.SwapConfig(**knobs)
    assert all(m.config == deferred.config for m in deferred.managers)
    assert_exact(expected, got)
    assert swap_pass.swap_stats().swap_ins == LAYERS - 2
    deferred.remove()


def test_converter_knobs_are_swap_configs():
    names = {f.name for f in dataclasses.fields(SwapLayerInputConverter.Config)}
    assert names - {"filter_fqns"} == {f.name for f in dataclasses.fields(swap_pass.SwapConfig)}
    assert SwapLayerInputConverter.Config().swap_config() == swap_pass.SwapConfig()


def test_converter_refuses_bad_knobs_and_a_second_conversion():
    with pytest.raises(ValueError, match="prefetch_layers=0"):
        _converted(prefetch_layers=0)
    with pytest.raises(TypeError, match="filter_fqns"):
        _converted(filter_fqns=[0])
    with pytest.raises(TypeError, match="filter_fqns"):
        _converted(filter_fqns="layers.0")
    model = _converted(filter_fqns=["layers.0", "layer.1"])  # a typo fails at the first forward
    with pytest.raises(ValueError, match=r"filter_fqns \['layer.1'\] name none of the blocks "
                                         r"\(layers.0, layers.1, layers.2, layers.3\)"):
        model(tc.make_batch()[0])
    assert deferred_swap(model).handle is None
    converters = [SwapLayerInputConverter.Config(), SwapLayerInputConverter.Config()]
    with pytest.raises(ValueError, match="list SwapLayerInputConverter once"):
        model_registry("debugmodel", converters=converters)


def test_converted_blocks_compiled_by_module_compile_are_refused_at_first_forward():
    # torchtitan's compile.enable compiles each block with nn.Module.compile() inside
    # parallelize_fn, after the model was built: swap is enabled (and refused) at the first
    # forward, naming swap_pass.compile_layers
    model = _converted()
    for block in model.layers.values():
        block.compile(backend="aot_eager")
    with pytest.raises(RuntimeError, match="swap_pass.compile_layers"):
        model(tc.make_batch()[0])
    assert deferred_swap(model).handle is None


def test_copy_of_armed_model_swaps_on_its_own():
    import copy

    model = _converted()
    twin = copy.deepcopy(model)  # e.g. torchtitan's pipeline split copies the model per stage
    assert deferred_swap(twin) is not deferred_swap(model)
    assert deferred_swap(twin).model is twin
    batch = tc.make_batch()
    assert_exact(tc.train_step(model, batch), tc.train_step(twin, batch))
    assert deferred_swap(twin).layers == list(twin.layers.values())
    assert swap_pass.swap_stats().swap_ins == 2 * (LAYERS - 1)
    deferred_swap(twin).remove()
    assert deferred_swap(model).active
