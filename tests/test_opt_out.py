"""``no_swap()`` and ``module_filter_fn`` through every way in; the prefetch and copy knobs.

Each test compares with the same model without swap (``torch.equal``), and checks what moved
(``swap_stats()``) and what was freed (storage sizes), so that it fails without the opt-out.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig, no_swap
from swap_pass.runtime.chain import SwapLayerInputManager
from swap_pass.runtime.freeing import in_backward
from swap_pass.tools.models import make_batch
from tests.eager.helpers import CFG, CheckpointedModel, assert_clean, assert_exact, train_step

L = CFG.num_layers


def _model(num_layers: int = L) -> CheckpointedModel:
    torch.manual_seed(0)
    return CheckpointedModel(dataclasses.replace(CFG, num_layers=num_layers), "non_reentrant")


def _batch(model):
    return make_batch(model.cfg, 2, 8, seed=0)


def _inputs_freed_after_forward(model, batch) -> tuple[torch.Tensor, list[bool]]:
    """Forward only: the loss, and for each layer whether its input lost its device storage."""
    seen = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, a: None if in_backward() else seen.append(a[0])) for layer in model.layers]
    loss = model(*batch)
    for h in hooks:
        h.remove()
    return loss, [x.untyped_storage().nbytes() == 0 for x in seen]


# --- no_swap ------------------------------------------------------------------------------------


def test_no_swap_keeps_every_layer_input_counted_then_swapping_resumes():
    model = _model()
    ref = copy.deepcopy(model)
    batch = _batch(model)
    handle = swap_pass.enable_swap_layer_input(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the user's opt-out warns nowhere
        with no_swap():
            loss, freed = _inputs_freed_after_forward(model, batch)
    assert freed == [False] * L
    loss.backward()
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 0 and stats.swap_outs == 0
    layer_input = 2 * 8 * CFG.hidden_size * 4
    assert stats.skipped_bytes["no_swap"] == (L - 1) * layer_input
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_exact(train_step(ref, batch), (loss.detach(), grads))
    model.zero_grad(set_to_none=True)
    _, freed = _inputs_freed_after_forward(model, batch)  # outside the block: swapped again
    assert freed == [True] * (L - 1) + [False]
    swap_pass.reset()
    handle.remove()


def test_no_swap_is_per_thread():
    import threading

    inside = []

    def other():
        inside.append(swap_pass.opt_out.swap_allowed())

    with no_swap():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert not swap_pass.opt_out.swap_allowed()
    assert inside == [True] and swap_pass.opt_out.swap_allowed()


def test_no_swap_in_a_compiled_graph_keeps_the_saved_inputs_on_the_device():
    model = _model()
    ref = copy.deepcopy(model)
    batch = _batch(model)
    backend = swap_pass.make_swap_backend("aot_eager")
    compiled = torch.compile(model, backend=backend)
    plain = torch.compile(ref, backend="aot_eager")
    expected = train_step(plain, batch)
    assert_exact(expected, train_step(compiled, batch))  # the graph swaps ...
    assert swap_pass.swap_stats().swapped_out_bytes > 0
    swap_pass.reset()
    compiled.zero_grad(set_to_none=True)
    with no_swap():  # ... and the same compiled graph, inside the block, does not
        loss = compiled(*batch)
    loss.backward()
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == stats.swapped_in_bytes == 0
    assert stats.skipped_bytes["no_swap"] == (L - 1) * 2 * 8 * CFG.hidden_size * 4
    grads = {n: p.grad.clone() for n, p in compiled.named_parameters()}
    assert_exact(expected, (loss.detach(), grads))


def test_no_swap_under_smartswap_leaves_saved_tensors_to_autograd():
    from tests.smart.helpers import Pair

    pair = Pair()
    with swap_pass.SmartSwap(pair.model, memory_budget=0.25) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        before = swap_pass.swap_stats()
        pair.step(smart, seed=3)  # a stable step swaps ...
        stable = swap_pass.swap_stats()
        assert stable.swapped_out_bytes > before.swapped_out_bytes
        with no_swap():
            pair.step(smart, seed=4)  # ... the same step inside the block does not (exact)
        after = swap_pass.swap_stats()
    assert after.swapped_out_bytes == stable.swapped_out_bytes
    assert after.skipped_bytes["no_swap"] > 0


# --- module_filter_fn --------------------------------------------------------------------------


def _keep_all_but_layer_1(module, fqn):
    assert isinstance(module, torch.nn.Module)
    return fqn != "layers.1"


def test_enable_module_filter_leaves_the_refused_block_alone():
    model = _model()
    ref = copy.deepcopy(model)
    batch = _batch(model)
    handle = swap_pass.enable_swap_layer_input(model, module_filter_fn=_keep_all_but_layer_1)
    assert handle.layers == [model.layers[0], model.layers[2], model.layers[3]]
    assert not hasattr(model.layers[1], "swap_manager")
    loss, freed = _inputs_freed_after_forward(model, batch)
    assert freed == [True, False, True, False]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_exact(train_step(ref, batch), (loss.detach(), grads))
    assert swap_pass.swap_stats().swapped_out_bytes == 2 * (2 * 8 * CFG.hidden_size * 4)
    handle.remove()
    assert_clean()


def test_enable_module_filter_that_refuses_every_block_is_an_error():
    model = _model()
    with pytest.raises(ValueError, match="module_filter_fn returned False for all 4 blocks"):
        swap_pass.enable_swap_layer_input(model, module_filter_fn=lambda m, fqn: False)
    with pytest.raises(TypeError, match="module_filter_fn=.* must be a callable"):
        swap_pass.enable_swap_layer_input(model, module_filter_fn="layers.1")
    assert not SwapLayerInputManager.manager_map


def test_compiled_module_filter_swaps_only_the_kept_layers():
    model = _model()
    ref = copy.deepcopy(model)
    batch = _batch(model)
    backend = swap_pass.make_swap_backend(
        "aot_eager", module_filter_fn=lambda module, fqn: fqn != "layers.1")
    compiled = torch.compile(model, backend=backend)
    assert_exact(train_step(torch.compile(ref, backend="aot_eager"), batch),
                 train_step(compiled, batch))
    swapped = [s.layer for p in backend.partitions for s in p.swapped]
    assert swapped == ["layers.0", "layers.2"]


def test_apply_swap_pass_module_filter_gets_the_traced_submodule():
    from swap_pass.tools.models import LlamaStyleModel

    torch.manual_seed(0)
    model = LlamaStyleModel(CFG)
    ref = copy.deepcopy(model)
    batch = _batch(model)
    asked = []

    def keep(module, fqn):  # symbolic_trace keeps each layer as a Module with its parameters
        asked.append((fqn, sum(p.numel() for p in module.parameters())))
        return fqn != "layers.2"

    gm = swap_pass.apply_swap_pass(torch.fx.symbolic_trace(model), module_filter_fn=keep)
    per_layer = sum(p.numel() for p in model.layers[0].parameters())
    assert asked == [(f"layers.{i}", per_layer) for i in range(L)]
    assert [b.fqn for b in gm.meta["swap_pass_layers"]] == ["layers.0", "layers.1", "layers.3"]
    assert_exact(train_step(ref, batch), train_step(gm, batch))
    assert swap_pass.swap_stats().swapped_out_bytes == 2 * (2 * 8 * CFG.hidden_size * 4)


def test_compile_layers_module_filter_compiles_all_and_swaps_the_kept_ones():
    model = _model()
    handle = swap_pass.compile_layers(model, backend="aot_eager",
                                      module_filter_fn=_keep_all_but_layer_1)
    assert handle.swap.layers == [model.layers[0], model.layers[2], model.layers[3]]
    assert len(handle.layers) == L
    handle.remove()


def test_smartswap_module_filter_keeps_the_refused_module_saved_tensors():
    from tests.smart.helpers import Pair

    pair = Pair()
    asked = set()

    def keep(module, fqn):
        asked.add(fqn)
        return not fqn.startswith("layers.0")

    with swap_pass.SmartSwap(pair.model, memory_budget=0.25, module_filter_fn=keep) as smart:
        for s in range(3):
            pair.step(smart, seed=s)
        entries = smart.policy.entries
    assert {"", "layers", "layers.0"} <= asked
    assert swap_pass.swap_stats().skipped_bytes["module_filter"] > 0
    assert swap_pass.swap_stats().swapped_out_bytes > 0
    assert not any(e.fqn.startswith("layers.0") for e in entries)  # never even tracked
    assert any(e.swap for e in entries)


# --- SwapConfig knobs --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error", [
    ({"prefetch_layers": 0}, ValueError), ({"prefetch_layers": True}, TypeError),
    ({"prefetch_layers": 1.0}, TypeError), ({"max_copies_in_flight": 0}, ValueError),
    ({"max_copies_in_flight": "2"}, TypeError),
])
def test_config_knobs_are_validated(kwargs, error):
    name = next(iter(kwargs))
    with pytest.raises(error, match=f"swap_pass.SwapConfig: {name}=.*It must be an int >= 1"):
        SwapConfig(**kwargs)


def test_config_knob_defaults_are_the_former_behaviour():
    config = SwapConfig()
    assert config.prefetch_layers == 1 and config.max_copies_in_flight is None


def _most_copies_back_in_flight(config: SwapConfig, num_layers: int = 7):
    """Train one step under ``config``; the most groups in "h2d" seen at each layer's guard."""
    model = _model(num_layers)
    ref = copy.deepcopy(model)
    batch = _batch(model)
    handle = swap_pass.enable_swap_layer_input(model, config=config)
    seen = []

    def sample(grad):
        seen.append(sum(g.stat == "h2d" for m in handle.managers for g in m.batch_stack))

    def hook_output(module, args, out):
        if out.requires_grad:
            out.register_hook(sample)

    hooks = [layer.register_forward_hook(hook_output) for layer in model.layers]
    got = train_step(model, batch)
    for h in hooks:
        h.remove()
    assert_exact(train_step(ref, batch), got)
    handle.remove()
    assert_clean()
    return max(seen)


@pytest.mark.parametrize("config, most", [
    (SwapConfig(), 1),
    (SwapConfig(prefetch_layers=3), 3),
    (SwapConfig(prefetch_layers=3, max_copies_in_flight=2), 2),
])
def test_prefetch_layers_and_max_copies_in_flight_bound_the_copies_back(config, most):
    assert _most_copies_back_in_flight(config) == most
