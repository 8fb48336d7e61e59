"""swap_backend under torch.compile: graph shape, ordering, gradients, recompiles, HF Llama."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import swap_pass
from swap_pass import SwapConfig, make_swap_backend
from swap_pass.graph.boundaries import find_layers
from swap_pass.graph.budget import CostModel
from swap_pass.tools.bench.hf_offload import hf_checkpointing_enable
from tests.conftest import DEVICES

from .helpers import (
    PREFETCH_CHANGES_INDUCTOR_FUSION,
    PREFETCH_FUSION_RTOL,
    assert_grads_equal,
    batch,
    hf_llama_tiny,
    rel_diff,
    tiny_model,
    twin,
)

L = 3
OPS = torch.ops.swap_pass
FAST = CostModel(copy_bytes_per_s=1e12, flops_per_s=1e12)  # every copy hides: choice by bytes


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _train(model, backend, steps=1, seq=8, **compile_kwargs):
    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True, **compile_kwargs)
    losses, grads = [], []
    for step in range(steps):
        loss = compiled(*batch(model, seq, seed=step))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    return counter, losses, grads


@pytest.fixture(scope="module", params=DEVICES)
def run_device(request) -> torch.device:
    """The ``device`` fixture's devices, for the module-scoped run below."""
    return torch.device(request.param)


@pytest.fixture(scope="module", params=[True, False], ids=["checkpointed", "plain"])
def aot_eager_run(request, run_device):
    model = tiny_model(L, recompute=request.param, device=run_device)
    ref = twin(model)
    backend = make_swap_backend("aot_eager")
    swap_pass.reset()
    counter, losses, grads = _train(model, backend, steps=2)
    stats = swap_pass.swap_stats()
    _, ref_losses, ref_grads = _train(ref, "aot_eager", steps=2)
    return dict(backend=backend, counter=counter, losses=losses, grads=grads, stats=stats,
                ref_losses=ref_losses, ref_grads=ref_grads)


def test_aot_eager_bitwise_equal_to_aot_eager_without_swap(aot_eager_run):
    r = aot_eager_run
    for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert torch.equal(loss, ref)
    for step_grads, ref_grads in zip(r["grads"], r["ref_grads"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_grads, ref_grads, strict=True))
    assert r["counter"].frame_count == 1  # fullgraph=True and no recompile on step 2


def test_runtime_moved_every_saved_layer_input(aot_eager_run):
    stats, partition = aot_eager_run["stats"], aot_eager_run["backend"].partitions[-1]
    assert [s.layer for s in partition.swapped] == [f"layers.{i}" for i in range(L - 1)]
    assert stats.swap_outs == stats.swap_ins == 2 * (L - 1)
    assert stats.swapped_out_bytes == 2 * sum(s.nbytes for s in partition.swapped)
    assert stats.host_bytes_in_use == 0


def _swap_graph(run, which: str, start_op):
    """The rewritten forward or backward graph, checked to hold L-1 start ops and L-1 waits."""
    gm = getattr(run["backend"].partitions[-1], which)
    targets = _targets(gm)
    assert targets.count(start_op) == L - 1 and targets.count(OPS.wait.default) == L - 1
    return gm, {n: i for i, n in enumerate(gm.graph.nodes)}


def test_forward_graph_swaps_out_and_waits_by_the_next_layer(aot_eager_run):
    fw, order = _swap_graph(aot_eager_run, "forward", OPS.swap_out.default)
    layers = find_layers(fw)
    output = fw.graph.find_nodes(op="output")[0]
    for i, wait in enumerate(n for n in fw.graph.nodes if n.target == OPS.wait.default):
        host, x, _ = wait.args
        assert x is layers[i].input and host.target == OPS.swap_out.default
        assert wait in output.args[0] and x not in output.args[0]  # the host copy is saved
        assert order[wait] > order[layers[i + 1].input]  # after layer i produced x_{i+1} ...
        assert order[wait] < order[layers[i + 1].members[-1]]  # ... and before layer i+1 ends


def test_backward_graph_prefetches_one_layer_ahead(aot_eager_run):
    bw, order = _swap_graph(aot_eager_run, "backward", OPS.prefetch.default)
    layers = {layer.boundary.fqn: layer for layer in find_layers(bw)}
    for prefetch in (n for n in bw.graph.nodes if n.target == OPS.prefetch.default):
        host = prefetch.args[0]
        assert host.op == "placeholder" and host.meta["val"].device.type == "cpu"
        (wait,) = [u for u in prefetch.users if u.target == OPS.wait.default]
        readers = [u for u in wait.users]
        assert readers and all(order[wait] < order[r] for r in readers)
        assert set(host.users) == {prefetch, wait}  # nobody reads the host copy directly
        layer = next(s.layer for s in aot_eager_run["backend"].partitions[-1].swapped
                     if s.name == host.name)
        after = layers[f"layers.{int(layer.split('.')[1]) + 1}"]
        assert order[prefetch] <= min(order[m] for m in after.members)


def _assert_like_aot_eager(grads, device="cpu", recompute=True):
    _, _, ref_grads = _train(tiny_model(L, recompute=recompute, device=device), "aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(grads[0], ref_grads[0], strict=True))


def test_without_prefetch_backward_holds_blocking_swap_ins(device):
    backend = make_swap_backend("aot_eager", config=SwapConfig(prefetch=False))
    _, _, grads = _train(tiny_model(L, recompute=True, device=device), backend)
    targets = _targets(backend.partitions[-1].backward)
    assert targets.count(OPS.swap_in.default) == L - 1 and OPS.prefetch.default not in targets
    _assert_like_aot_eager(grads, device)


def test_callable_inner_is_used_for_forward_and_backward():
    seen = []

    def inner(gm, example_inputs):
        seen.append(OPS.swap_out.default in _targets(gm) or OPS.prefetch.default in _targets(gm))
        return gm

    _, _, grads = _train(tiny_model(L, recompute=True), make_swap_backend(inner))
    assert seen == [True, True]
    _assert_like_aot_eager(grads)


@pytest.mark.slow
def test_changing_sequence_length():
    """Static: at most one recompile per new shape (automatic dynamic: one in all); dynamic=True:
    none."""
    seqs = (8, 12, 16)
    for dynamic in (None, True):
        counts, ref_counts = [], []
        model = tiny_model(L, recompute=True)
        ref = twin(model)
        for compiled_model, backend, out in ((model, make_swap_backend("aot_eager"), counts),
                                             (ref, "aot_eager", ref_counts)):
            counter = CompileCounterWithBackend(backend)
            torch._dynamo.reset()
            compiled = torch.compile(compiled_model, backend=counter, fullgraph=True,
                                     dynamic=dynamic)
            for seq in seqs:
                compiled(*batch(compiled_model, seq)).backward()
                out.append(counter.frame_count)
        assert counts == ref_counts, (dynamic, counts, ref_counts)
        assert counts[-1] - counts[0] <= (1 if dynamic is None else 0), (dynamic, counts)
        assert_grads_equal(model, ref)  # accumulated over the three shapes
    assert swap_pass.swap_stats().swap_outs >= 2 * len(seqs) * (L - 1)


@pytest.mark.slow
def test_inductor_checkpointed_bitwise_equal_to_inductor_without_swap(deterministic):
    model = tiny_model(L, recompute=True)
    ref = twin(model)
    backend = make_swap_backend()  # inductor
    swap_pass.reset()
    counter, losses, grads = _train(model, backend)
    # each swapped buffer dies after its wait, where the counter sees it (Note: [One buffer from
    # swap_out to wait] in swap_pass/graph/aot_pass.py)
    assert swap_pass.swap_stats().peak_device_bytes_released > 0
    _, ref_losses, ref_grads = _train(ref, "inductor")
    assert counter.frame_count == 1
    fw, bw = backend.partitions[-1].forward, backend.partitions[-1].backward
    assert _targets(fw).count(OPS.swap_out.default) == L - 1
    assert _targets(bw).count(OPS.prefetch.default) == L - 1
    assert torch.equal(losses[0], ref_losses[0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], ref_grads[0], strict=True))
    assert swap_pass.swap_stats().swap_outs == L - 1


def _hf_llama_step(backend, checkpoint: bool, steps: int = 1):
    """Losses and the last step's named gradients of HF Llama (tiny, random weights) trained
    with SGD under ``torch.compile(backend=...)``."""
    model = hf_llama_tiny(num_layers=L)
    model.config.use_cache = False  # with checkpointing, HF would log that it turns the cache off
    if checkpoint:
        hf_checkpointing_enable(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch._dynamo.reset()
    compiled = torch.compile(model.train(), backend=backend, fullgraph=True)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        if step < steps - 1:
            opt.step()
    return losses, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    "layer_input_checkpointed",
    "budget",
])
def test_hf_llama_under_inductor_bitwise_equal_to_inductor_without_swap(mode, deterministic):
    """HF Llama under Inductor, two steps: layer inputs with checkpointing, and budget mode
    without; every loss and every gradient is bitwise equal to the same compile without swap."""
    checkpoint = mode != "budget"
    backend = (make_swap_backend() if checkpoint else
               make_swap_backend(memory_budget=0.5, cost_model=FAST))
    swap_pass.reset()
    losses, grads = _hf_llama_step(backend, checkpoint, steps=2)
    ref_losses, ref_grads = _hf_llama_step("inductor", checkpoint, steps=2)
    swapped = backend.partitions[-1].swapped
    if checkpoint:
        assert [s.layer for s in swapped] == [f"model.layers.{i}" for i in range(L - 1)]
    assert swapped and swap_pass.swap_stats().swap_outs == 2 * len(swapped)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (
        losses, ref_losses)
    if checkpoint and PREFETCH_CHANGES_INDUCTOR_FUSION:
        # docs/graph.md, "Inductor on torch 2.14 and later": the written tolerance, nothing looser
        far = {name: rel_diff(grads[name], ref_grads[name]) for name in grads}
        assert max(far.values()) <= PREFETCH_FUSION_RTOL, far
        return
    differ = [name for name in grads if not torch.equal(grads[name], ref_grads[name])]
    assert not differ, differ


def test_unknown_inner_is_an_error():
    with pytest.raises(ValueError, match=r"swap_pass\.make_swap_backend: inner='tvm' is not a known"
                                         r" compiler\. It must be one of"):
        make_swap_backend("tvm")


def test_npu_inner_points_to_regional_compile():
    with pytest.raises(ValueError, match=r"swap_pass\.make_swap_backend: inner='npu' is not "
                                         r"supported\..*swap_pass\.compile_layers\(model, "
                                         r"backend='npu'\)"):
        make_swap_backend("npu")


def test_compile_options_for_another_inner_compiler_are_an_error():
    model = tiny_model(L, recompute=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_swap_backend("aot_eager"), mode="max-autotune")
    with pytest.raises(Exception, match=r"configures Inductor, but this backend compiles with "
                                        r"inner='aot_eager'"):
        compiled(*batch(model))


@pytest.mark.parametrize("asked", ["mode", "options", "config"])
def test_cuda_graphs_on_an_accelerator_are_refused_before_the_first_step(device, asked):
    """Whole-model CUDA graphs cannot replay the swap ops (Note: [Whole-model CUDA graphs]): on
    an accelerator the first compile refuses them, before any step ran, naming the modes that
    swap and compile_layers."""
    if device.type == "cpu":
        pytest.skip("Inductor captures no CUDA graph for CPU tensors (the refusal is for devices)")
    model = tiny_model(L, recompute=True, device=device)
    before = [p.detach().clone() for p in model.parameters()]
    torch._dynamo.reset()
    kwargs = {"mode": {"mode": "reduce-overhead"},
              "options": {"options": {"triton.cudagraphs": True}}, "config": {}}[asked]
    compiled = torch.compile(model, backend=make_swap_backend(), **kwargs)
    with torch._inductor.config.patch({"triton.cudagraphs": asked == "config"}):
        with pytest.raises(Exception, match=r"asks Inductor to capture CUDA graphs.*"
                                            r"mode='max-autotune-no-cudagraphs'.*"
                                            r"swap_pass\.compile_layers\(model, swap=False"):
            compiled(*batch(model)).backward()
    assert swap_pass.swap_stats().swap_outs == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_forward_without_backward_and_no_grad_leave_nothing(device):
    import gc

    model = tiny_model(L, recompute=True, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_swap_backend("aot_eager"), fullgraph=True)
    loss = compiled(*batch(model))
    assert swap_pass.swap_stats().host_bytes_in_use > 0  # saved host copies of L-1 inputs
    del loss  # no backward: the saved host copies die with the graph
    gc.collect()
    assert swap_pass.swap_stats().host_bytes_in_use == 0
    before = swap_pass.swap_stats().swap_outs
    with torch.no_grad():
        compiled(*batch(model))
    assert swap_pass.swap_stats().swap_outs == before  # inference graph: nothing saved, no swap


def test_host_cap_applies_to_the_compiled_path(device):
    """The refused host buffer raises mid-forward; the first layer's swapped-out input dies
    before its wait, its copy out still queued. On the test accelerator swap_out's finalizer must
    order the compute stream after that copy before the compute stream's next allocation takes
    the block (Note: [Sources that die unwaited] in swap_pass/graph/ops.py), or the device counts
    an unordered free."""
    model = tiny_model(L, recompute=True, device=device)
    torch._dynamo.reset()
    backend = make_swap_backend("aot_eager", config=SwapConfig(max_host_bytes=1024))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with pytest.raises(swap_pass.HostMemoryError, match=r"max_host_bytes=1024 would be passed"):
        compiled(*batch(model))


@pytest.mark.slow
def test_inductor_caches_never_hand_back_an_unswapped_graph(tmp_path, monkeypatch):
    """Plain inductor first, then swap_backend twice with caches on: the swap compile must not
    hit the plain entry (its key carries the partitioner's uuid), and a hit of its own entry
    (the second time) must still swap."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with inductor_config.patch(fx_graph_cache=True), \
            functorch_config.patch(enable_autograd_cache=True):
        _train(tiny_model(L, recompute=True), "inductor")
        assert swap_pass.swap_stats().swap_outs == 0
        for attempt in range(2):
            swap_pass.reset()
            backend = make_swap_backend()
            _train(tiny_model(L, recompute=True), backend)
            stats = swap_pass.swap_stats()
            assert (stats.swap_outs, stats.swap_ins) == (L - 1, L - 1), attempt
            assert stats.host_bytes_in_use == 0
            # the first swap compile partitions; the second is a cache hit that still swaps
            assert len(backend.partitions) == (1 if attempt == 0 else 0)


@pytest.mark.parametrize("boxed", [True, False], ids=["boxed", "unboxed"])
def test_callable_inner_may_return_boxed_or_plain_functions(boxed):
    from functorch.compile import make_boxed_func

    def inner(gm, example_inputs):
        return make_boxed_func(gm.forward) if boxed else gm.forward

    backend = make_swap_backend(inner)
    _, _, grads = _train(tiny_model(L, recompute=True), backend)
    assert _targets(backend.partitions[-1].forward).count(OPS.swap_out.default) == L - 1
    _assert_like_aot_eager(grads)


class _ViewedEmbedding(torch.nn.Embedding):
    """An embedding whose output the next layer reads through a view (as a classic TP plan's
    first layer reads ``view(wait_tensor(all_reduce(...)))``)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = super().forward(ids)
        h = h @ torch.eye(h.shape[-1], dtype=h.dtype)  # a matmul: saved, never recomputed
        return h.view(h.shape)


def test_a_layer_input_read_through_a_view_swaps_the_saved_tensor_it_views():
    model = tiny_model(L)
    viewed = _ViewedEmbedding(*model.embed.weight.shape)
    viewed.weight = model.embed.weight
    model.embed = viewed
    ref = twin(model)
    backend = make_swap_backend("aot_eager")
    swap_pass.reset()
    _, losses, grads = _train(model, backend, steps=2)
    _, ref_losses, ref_grads = _train(ref, "aot_eager", steps=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    for step_grads, step_ref in zip(grads, ref_grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_grads, step_ref, strict=True))
    partition = backend.partitions[-1]
    assert [s.layer for s in partition.swapped] == [f"layers.{i}" for i in range(L - 1)]
    assert partition.swapped[0].name == "mm"  # the tensor the layer's input views, not the view
    assert swap_pass.swap_stats().host_bytes_in_use == 0
