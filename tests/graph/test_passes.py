"""apply_swap_pass trained in eager autograd: storages freed, restored, gradients bitwise equal."""

from __future__ import annotations

import gc

import pytest
import torch

import swap_pass
from swap_pass import SwapConfig, apply_swap_pass
from swap_pass.graph.passes import layer_input_release, layer_input_swap_out

from .helpers import TraceableLlama, assert_grads_equal, batch, tiny_model, trace, twin

L = 4


def _swap_nodes(gm):
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return targets.count(layer_input_swap_out), targets.count(layer_input_release)


def _record_layer_inputs(gm):
    """Pre-hooks on the call_module layers: each layer's input, and which earlier inputs are freed
    then."""
    seen, freed_at_entry = [], []

    def hook(module, args):
        freed_at_entry.append([x.untyped_storage().nbytes() == 0 for x in seen])
        seen.append(args[0])

    layers = [gm.get_submodule(f"model.layers.{i}") for i in range(L)]
    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    return seen, freed_at_entry, handles


@pytest.mark.parametrize("leaf_layers", [False, True], ids=["inlined", "call_module"])
def test_graph_holds_swap_nodes_for_all_but_the_last_layer(leaf_layers):
    ref = TraceableLlama(tiny_model(L))
    gm = apply_swap_pass(trace(twin(ref), leaf_layers=leaf_layers), ref.inputs())
    assert _swap_nodes(gm) == (L - 1, L - 1)
    assert [b.fqn for b in gm.meta["swap_pass_layers"]] == [f"model.layers.{i}" for i in range(L)]
    assert ("swap_pass_out_model_layers_0" in gm.code
            and "swap_pass_release_model_layers_2" in gm.code)


def test_inputs_freed_after_next_layer_ran_and_grads_bitwise_equal(device):
    ref = TraceableLlama(tiny_model(L, device=device))
    gm = apply_swap_pass(trace(twin(ref), leaf_layers=True))
    seen, freed_at_entry, _ = _record_layer_inputs(gm)
    loss = gm(*ref.inputs())
    # layer i-1's input is freed once layer i-1 ran, at layer i's entry (the eager protocol)
    assert freed_at_entry == [[], [True], [True, True], [True, True, True]]
    assert [x.untyped_storage().nbytes() == 0 for x in seen] == [True] * (L - 1) + [False]
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == L - 1 and stats.device_bytes_released == sum(
        x.untyped_storage().nbytes() or x.numel() * x.element_size() for x in seen[:-1])
    loss.backward()
    ref_loss = ref(*ref.inputs())
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert_grads_equal(gm, ref)
    assert all(x.untyped_storage().nbytes() > 0 for x in seen)
    stats = swap_pass.swap_stats()
    assert stats.swap_ins == L - 1 and stats.host_bytes_in_use == 0


@pytest.mark.parametrize("prefetch", [True, False])
def test_inlined_trace_trains_bitwise_over_steps(prefetch, device):
    ref = TraceableLlama(tiny_model(L, device=device))
    gm = apply_swap_pass(trace(twin(ref)), ref.inputs(), config=SwapConfig(prefetch=prefetch))
    opt_a = torch.optim.SGD(gm.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        args = ref.inputs(seed=step)
        la, lb = gm(*args), ref(*args)
        la.backward()
        lb.backward()
        assert torch.equal(la, lb)
        assert_grads_equal(gm, ref)
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
    assert swap_pass.swap_stats().swap_outs == 3 * (L - 1)


def test_gradient_accumulation_two_forwards_one_backward():
    ref = TraceableLlama(tiny_model(L))
    gm = apply_swap_pass(trace(twin(ref)), ref.inputs())
    loss = gm(*ref.inputs(seed=1)) + gm(*ref.inputs(seed=2))
    loss.backward()
    (ref(*ref.inputs(seed=1)) + ref(*ref.inputs(seed=2))).backward()
    assert_grads_equal(gm, ref)
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def test_no_grad_and_forward_without_backward_leave_nothing():
    ref = TraceableLlama(tiny_model(L))
    gm = apply_swap_pass(trace(twin(ref)), ref.inputs())
    with torch.no_grad():
        assert torch.equal(gm(*ref.inputs()), ref(*ref.inputs()))
    assert swap_pass.swap_stats().swap_outs == 0
    loss = gm(*ref.inputs())  # no backward: the graph is dropped
    assert swap_pass.swap_stats().host_bytes_in_use > 0
    del loss
    gc.collect()
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def test_retain_graph_second_backward(device):
    ref = TraceableLlama(tiny_model(L, device=device))
    gm = apply_swap_pass(trace(twin(ref)), ref.inputs())
    loss, ref_loss = gm(*ref.inputs()), ref(*ref.inputs())
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    assert_grads_equal(gm, ref)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_dynamo_graph_trained_eagerly(recompute, device):
    """apply_swap_pass as the transform of a Dynamo backend; the compiled function runs eagerly."""
    ref = tiny_model(L, recompute=recompute, device=device)
    model = twin(ref)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(apply_swap_pass(gm))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(*batch(ref))
    assert _swap_nodes(graphs[0]) == (L - 1, L - 1)
    assert swap_pass.swap_stats().device_bytes_released > 0
    loss.backward()
    ref_loss = ref(*batch(ref))
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert_grads_equal(model, ref)


def test_layer_filter_limits_the_swapped_layers():
    ref = TraceableLlama(tiny_model(L))
    gm = apply_swap_pass(trace(twin(ref)), ref.inputs(), layer_filter=r"model\.layers\.[012]")
    assert _swap_nodes(gm) == (2, 2)


def test_errors_name_the_api():
    with pytest.raises(TypeError,
                       match=r"swap_pass\.apply_swap_pass: expected a torch\.fx\.GraphModule"):
        apply_swap_pass(tiny_model(2))
    gm = trace(TraceableLlama(tiny_model(2)))
    with pytest.raises(ValueError,
                       match=r"swap_pass\.apply_swap_pass: layer_filter='nope' matched none"):
        apply_swap_pass(gm, layer_filter="nope")


def test_graph_without_layers_warns_and_is_unchanged():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    code = gm.code
    with pytest.warns(UserWarning, match=r"swap_pass\.apply_swap_pass: found 0 layer"):
        assert apply_swap_pass(gm) is gm
    assert gm.code == code


def test_restored_inputs_die_as_backward_proceeds():
    """Once layer i's backward ran, its restored input must not be held to the end of the step."""
    import weakref

    ref = TraceableLlama(tiny_model(L))
    gm = apply_swap_pass(trace(twin(ref), leaf_layers=True))
    inputs, alive_at_layer1_grad = [], []

    def probe(grad):  # layer 1's input gradient: layers 2 and 3 finished their backward
        alive_at_layer1_grad.append(sum(r() is not None for r in inputs[2:]))

    def hook(module, args):
        inputs.append(weakref.ref(args[0]))
        if len(inputs) == 2:
            args[0].register_hook(probe)

    for i in range(L):
        gm.get_submodule(f"model.layers.{i}").register_forward_pre_hook(hook)
    loss = gm(*ref.inputs())
    assert swap_pass.swap_stats().swap_outs == L - 1
    loss.backward()
    assert alive_at_layer1_grad == [0]
