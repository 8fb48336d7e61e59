"""compile_layers: each layer compiled on its own, layer inputs swapped between them eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch

import swap_pass
from swap_pass import compile_layers

from .helpers import batch, skip_inductor_on_the_test_accelerator, tiny_model, twin

L = 3


def _run(model, backend, swap, **kwargs):
    """One step; returns the layer inputs' storage sizes after forward, and the handle."""
    torch._dynamo.reset()
    handle = compile_layers(model, backend=backend, swap=swap, **kwargs)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
             for layer in model.layers]
    loss = model(*batch(model))
    sizes = [x.untyped_storage().nbytes() for x in inputs]
    loss.backward()
    for hook in hooks:
        hook.remove()
    return sizes, handle


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_bitwise_equal_to_the_same_regional_compile_without_swap(backend, recompute, device):
    if backend == "inductor":
        skip_inductor_on_the_test_accelerator(device)
    model = tiny_model(L, recompute=recompute, device=device)
    ref = twin(model)
    swap_pass.reset()
    sizes, handle = _run(model, backend, swap=True)
    stats = swap_pass.swap_stats()
    _, ref_handle = _run(ref, backend, swap=False)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    x_bytes = batch(model)[0].numel() * model.cfg.hidden_size * 4
    assert sizes == [0] * (L - 1) + [x_bytes]  # freed between forward and backward; last kept
    assert stats.swap_outs == stats.swap_ins == L - 1 and stats.host_bytes_in_use == 0
    assert ref_handle.swap is None and handle.swap is not None
    handle.remove()
    ref_handle.remove()


def test_layers_are_compiled_and_remove_restores_them():
    model = tiny_model(L)
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    with compile_layers(model, backend=backend) as handle:
        assert all("forward" in layer.__dict__ for layer in model.layers)
        model(*batch(model)).backward()
        assert calls  # layers went through the backend
        with pytest.raises(RuntimeError, match=r"swap_pass\.compile_layers: the layers of this "
                                               r"LlamaStyleModel are already compiled"):
            compile_layers(model)
    assert not handle.active
    assert all("forward" not in layer.__dict__ and not hasattr(layer, "swap_manager")
               for layer in model.layers)


def test_user_inputs_and_buffers_keep_their_values(device):
    model = tiny_model(L, device=device)
    ids, labels = batch(model)
    ids0, labels0, cos0 = ids.clone(), labels.clone(), model.cos_table.clone()
    with compile_layers(model, backend="aot_eager"):
        model(ids, labels).backward()
    assert torch.equal(ids, ids0) and torch.equal(labels, labels0)
    assert torch.equal(model.cos_table, cos0)


def test_npu_backend_without_torch_npu_is_a_clear_error():
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed here: the torchair branch runs on an Ascend machine")
    except ImportError:
        pass
    model = tiny_model(L)
    with pytest.raises(RuntimeError, match=r"swap_pass\.compile_layers: backend='npu' needs "
                                           r"torch_npu and torchair"):
        compile_layers(model, backend="npu")
    assert all("forward" not in layer.__dict__ for layer in model.layers)


@pytest.mark.parametrize("api", ["enable_swap_layer_input", "compile_layers"])
@pytest.mark.parametrize("which", ["layer", "model"])
def test_module_compile_is_refused_naming_compile_layers(api, which):
    # nn.Module.compile (torchtitan's per-block compile) compiles the whole __call__: the swap
    # protocol around forward would run inside the compiled region, where Dynamo fails on it
    model = tiny_model(L)
    (model.layers[1] if which == "layer" else model).compile(backend="aot_eager")
    where = (r"layers\[1\] \(LlamaDecoderLayer\)" if which == "layer"
             else r"the model \(LlamaStyleModel\)")
    with pytest.raises(RuntimeError, match=rf"swap_pass\.{api}: {where} was compiled with "
                                           r"nn\.Module\.compile\(\).*swap_pass\.compile_layers"):
        getattr(swap_pass, api)(model)
    assert all("forward" not in layer.__dict__ and not hasattr(layer, "swap_manager")
               for layer in model.layers)


def test_model_without_repeated_layers_is_an_error():
    with pytest.raises(ValueError, match=r"found no nn\.ModuleList or nn\.ModuleDict"):
        compile_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                    {"options": {"triton.cudagraphs": True}}])
def test_cuda_graph_modes_on_cpu_warn_once_that_no_graph_is_captured(kwargs):
    """Inductor captures CUDA graphs only on CUDA devices and skips them on the CPU without a
    visible message (Note: [CUDA graphs only on CUDA]): compile_layers says so, once."""
    model = tiny_model(L)
    with pytest.warns(RuntimeWarning, match=r"swap_pass\.compile_layers: .* asks Inductor for "
                                            r"CUDA graphs.* on the CPU") as caught:
        compile_layers(model, backend="inductor", **kwargs).remove()
    ours = [w for w in caught if "CUDA graphs" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # once, pointing at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_layers(model, backend="inductor", **kwargs).remove()  # once until reset()
        compile_layers(model, backend="inductor").remove()
        compile_layers(model, backend="aot_eager").remove()


@pytest.mark.parametrize("kwargs", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                    {"options": {"triton.cudagraphs": True}}])
def test_cuda_graphs_with_swap_on_an_accelerator_are_refused_before_the_first_step(kwargs,
                                                                                   monkeypatch):
    """cudagraph trees keep layer outputs in a private pool, which a swap would free and restore
    outside (Note: [No CUDA graphs with swap]): refused, naming what to use instead. The layers
    are made to look as if they sat on a CUDA device; no CPU build can capture a graph."""
    from swap_pass.graph import regional

    model = tiny_model(L)
    monkeypatch.setattr(regional, "_layers_device", lambda found: torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"swap_pass\.compile_layers: .* asks Inductor for CUDA "
                                         r"graphs.*cuda:0.*mode='default' or "
                                         r"mode='max-autotune-no-cudagraphs'.*swap=False"):
        compile_layers(model, backend="inductor", **kwargs)
    assert all("forward" not in layer.__dict__ for layer in model.layers)  # left as it was
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_layers(model, backend="inductor", swap=False, **kwargs).remove()
        compile_layers(model, backend="inductor", mode="max-autotune-no-cudagraphs").remove()
