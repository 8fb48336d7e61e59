"""Budget mode of swap_backend, waits pinned behind their compute, and the whole-step peak."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import swap_pass
from swap_pass import make_swap_backend
from swap_pass.graph.budget import CostModel
from swap_pass.runtime.freeing import byte_span
from swap_pass.tools.bench.hf_llama_peak import hf_llama_step_peak
from swap_pass.tools.bench.measure import profile_step, warm_step_peak

from .helpers import (
    PREFETCH_CHANGES_INDUCTOR_FUSION,
    PREFETCH_FUSION_RTOL,
    batch,
    rel_diff,
    tiny_model,
    twin,
)

OPS = torch.ops.swap_pass
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
FAST = CostModel(copy_bytes_per_s=1e12, flops_per_s=1e12)  # every copy hides: choice by bytes


def _step(compiled, model, seq=8):
    compiled(*batch(model, seq)).backward()


def _compile_and_step(model, backend, seq=8):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _step(compiled, model, seq)
    return compiled


def _bytes_spanned(part) -> int:
    """The bytes the swapped tensors of ``part`` span: what their copies move (a strided slice
    copies its gaps too: Note: [Contiguous copies] in swap_pass/graph/ops.py)."""
    spans = [byte_span([n.args[0].meta["val"]]) for n in part.forward.graph.nodes
             if n.target is torch.ops.swap_pass.swap_out.default]
    return sum(hi - lo for lo, hi in spans)


def _outputs(gm):
    return list(gm.graph.find_nodes(op="output")[0].args[0])


def test_budget_mode_swaps_any_saved_tensor_bitwise(device):
    model = tiny_model(3, device=device)
    ref = twin(model)
    backend = make_swap_backend("aot_eager", memory_budget=0.5, cost_model=FAST)
    swap_pass.reset()
    _compile_and_step(model, backend)
    _compile_and_step(ref, "aot_eager")
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    part = backend.partitions[-1]
    assert part.mode == "budget" and part.predicted_peak <= part.budget_bytes
    assert part.budget_bytes == int(0.5 * part.predicted_peak_without_swap)
    assert len(part.swapped) > 2  # more than the two layer inputs of layer-input mode
    assert {s.layer for s in part.swapped} - {"layers.0", "layers.1"}  # not only layer inputs
    # the forward returns the host copies in place of the swapped tensors
    fw_out = {n.name: n for n in _outputs(part.forward) if isinstance(n, torch.fx.Node)}
    assert not {s.name for s in part.swapped} & set(fw_out)
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == len(part.swapped)
    # the bytes each swapped tensor spans: a transposed slice of the fused q/k/v projection
    # copies its gaps too (Note: [Contiguous copies] in swap_pass/graph/ops.py); the CPU graph
    # swaps one, an accelerator's (attention traced to other ops) need not
    assert stats.swapped_out_bytes == _bytes_spanned(part) >= sum(s.nbytes for s in part.swapped)
    assert device.type != "cpu" or stats.swapped_out_bytes > sum(s.nbytes for s in part.swapped)
    assert stats.host_bytes_in_use == 0
    assert "predicted peak" in part.summary() and part.swapped[0].name in part.summary()


def test_budget_that_already_fits_swaps_nothing():
    backend = make_swap_backend("aot_eager", memory_budget=1.0, cost_model=FAST)
    _compile_and_step(tiny_model(3), backend)
    part = backend.partitions[-1]
    assert part.swapped == [] and part.predicted_peak == part.predicted_peak_without_swap


def test_copies_that_cannot_hide_are_not_chosen():
    """A link this slow hides no copy behind the tiny model's compute: nothing is chosen, and the
    unmet budget is reported."""
    slow = CostModel(copy_bytes_per_s=1.0, flops_per_s=1e12)
    backend = make_swap_backend("aot_eager", memory_budget=0.5, cost_model=slow)
    with pytest.warns(UserWarning, match=r"memory_budget=0\.5 not reached"):
        _compile_and_step(tiny_model(3), backend)
    assert backend.partitions[-1].swapped == []


@pytest.mark.parametrize("bad", [-1, 0.0, 1.5, "half", True])
def test_invalid_budget_is_an_error(bad):
    with pytest.raises(ValueError,
                       match=r"swap_pass\.make_swap_backend: memory_budget=.* is invalid"):
        make_swap_backend("aot_eager", memory_budget=bad)


def test_invalid_cost_model_is_an_error():
    with pytest.raises(ValueError, match=r"swap_pass\.CostModel: flops_per_s=0 is invalid"):
        CostModel(flops_per_s=0)


def test_measured_cost_model_is_positive():
    cost = CostModel().resolved(torch.device("cpu"), torch.float32)
    assert cost.copy_bytes_per_s > 0 and cost.flops_per_s > 0


# The probes' dtype, side, real tensors and cache: tests/graph/test_budget_probes.py.


# --- waits at their planned position ----------------------------------------------------------


def test_every_wait_depends_on_the_matmul_computed_before_it():
    backend = make_swap_backend("aot_eager")
    _compile_and_step(tiny_model(4, recompute=True), backend)
    for gm in (backend.partitions[-1].forward, backend.partitions[-1].backward):
        waits = [n for n in gm.graph.nodes if n.target == OPS.wait.default]
        assert len(waits) == 3
        for w in waits:
            after, before = w.args[2], w.prev
            while before.target not in MATMULS:
                before = before.prev
            assert isinstance(after, torch.fx.Node) and after is before, (w, after, before)


_KERNEL = re.compile(r"^(?:\w+ = )?(?:cpp_fused|triton_|extern_kernels\.|torch\.ops\.)")
_WAIT = re.compile(r"^(\w+) = torch\.ops\.swap_pass\.wait\.default\((\w+), \w+, (.*)\)$")
_PREFETCH = re.compile(
    r"^(\w+) = torch\.ops\.swap_pass\.prefetch\.default\(.*?(?:True|False)(.*)\)$")


def _body(code: str) -> list[str]:
    return [line.strip() for line in code[code.index("def call("):].splitlines()]


def _assert_prefetches_behind_their_compute(lines: list[str]) -> None:
    """Each prefetch but the first carries the matmul it must follow, comes after the kernel
    that computes it, and kernels run between consecutive prefetches (none of them
    is hoisted to the top of the backward, where it would hold its tensor for the whole pass)."""
    starts = [(i, _PREFETCH.match(ln)) for i, ln in enumerate(lines) if _PREFETCH.match(ln)]
    assert len(starts) == 3
    for (i, _), (j, m) in zip(starts, starts[1:], strict=False):  # consecutive pairs
        after = re.search(r"\bbuf\d+\b", m.group(2))
        assert after is not None, lines[j]
        assert any(re.search(rf"\b{after.group(0)}\b", ln) for ln in lines[i + 1:j]
                   if _KERNEL.match(ln)), lines[i:j + 1]
        assert any(_KERNEL.match(ln) and "swap_pass" not in ln for ln in lines[i + 1:j])


@pytest.mark.slow
def test_inductor_output_code_keeps_every_wait_behind_its_compute():
    """4 checkpointed layers under Inductor: in the backward's output code each wait comes after
    a kernel, run after its prefetch, that reads or writes its ``after`` tensor (the compute the
    H2D copy hides behind), at least one kernel runs between each prefetch and its wait, and
    the prefetches stay one layer apart instead of all starting at the top."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_model(4, recompute=True)
    backend = make_swap_backend()
    torch._dynamo.reset()  # compile caches are off for every graph test (tests/graph/conftest.py)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _, codes = run_and_get_code(lambda: _step(compiled, model))
    lines = _body(next(c for c in codes if "swap_pass.prefetch" in c))
    alias = dict(re.fullmatch(r"(buf\d+) = (buf\d+)", ln).groups() for ln in lines
                 if re.fullmatch(r"buf\d+ = buf\d+", ln))
    waits = [(i, _WAIT.match(ln)) for i, ln in enumerate(lines) if _WAIT.match(ln)]
    assert len(waits) == 3
    _assert_prefetches_behind_their_compute(lines)
    for i, m in waits:
        dev, after = alias.get(m.group(2), m.group(2)), re.search(r"\bbuf\d+\b", m.group(3))
        assert after is not None, lines[i]  # the wait carries its dependency
        prefetch = next(j for j in range(i)
                        if lines[j].startswith(f"{dev} = torch.ops.swap_pass.prefetch"))
        kernels = [j for j in range(prefetch + 1, i) if _KERNEL.match(lines[j])]
        assert kernels, lines[prefetch:i + 1]
        assert any(re.search(rf"\b{after.group(0)}\b", lines[j]) for j in kernels), lines[i]


@pytest.mark.slow
def test_gpt2_under_inductor_warns_in_layer_input_mode_and_swaps_in_budget_mode():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_embd=16, n_layer=3, n_head=2, n_positions=16,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    layer_mode, budget_mode = make_swap_backend(), make_swap_backend(memory_budget=0.75,
                                                                     cost_model=FAST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend in (layer_mode, budget_mode):
            torch._dynamo.reset()
            torch.compile(model, backend=backend, fullgraph=True)(
                input_ids=ids).logits.sum().backward()
    assert layer_mode.partitions[-1].swapped == []
    assert any("holds 3 layers but saves none of their inputs" in str(w.message) for w in caught)
    assert len(budget_mode.partitions[-1].swapped) > 0


# --- the whole-step peak ----------------------------------------------------------------------


def _held_and_peak(model, backend, seq):
    """Bytes a forward leaves held for its backward, and the peak bytes of a whole step; both
    profiled after a warm-up step (see ``warm_step_peak``), above the bytes held before them."""
    cpu = torch.device("cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    peak = warm_step_peak(cpu, lambda: _step(compiled, model, seq),
                          lambda: model.zero_grad(set_to_none=True))
    model.zero_grad(set_to_none=True)
    kept = {}
    forward = profile_step(cpu, lambda: kept.update(loss=compiled(*batch(model, seq))))
    kept.pop("loss").backward()
    return forward.curve_bytes[-1], peak


def _saves_rng_state(gm: torch.fx.GraphModule) -> bool:
    """Whether a forward graph saves RNG states for its checkpointed regions' recompute."""
    return any("run_and_save_rng_state" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.slow
def test_whole_step_peak_of_hf_llama_under_inductor_falls_by_l_minus_2_layer_inputs(deterministic):
    """HF Llama, 4 checkpointed layers, Inductor: the profiled peak of a whole training step is
    at least L-2 layer inputs lower with swap than the same compile without it, and gradients
    are bitwise equal (on torch 2.14 and later within ``PREFETCH_FUSION_RTOL``: Inductor fuses
    the recomputed RoPE differently once prefetches sit in the backward; docs/graph.md, "Inductor
    on torch 2.14 and later"). Each prefetch stays behind the compute before its planned position:
    hoisted to the top of the backward (Inductor's peak-memory reordering is free to move a node
    that depends only on a graph input), all of them would be on the device at the peak."""
    layers = 4
    backend = make_swap_backend()
    peak, grads = hf_llama_step_peak(backend, layers=layers, checkpoint=True)
    ref_peak, ref_grads = hf_llama_step_peak("inductor", layers=layers, checkpoint=True)
    if PREFETCH_CHANGES_INDUCTOR_FUSION:
        far = [rel_diff(a, b) for a, b in zip(grads, ref_grads, strict=True)]
        assert max(far) <= PREFETCH_FUSION_RTOL, far
    else:
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    x_bytes = backend.partitions[-1].swapped[0].nbytes
    assert len(backend.partitions[-1].swapped) == layers - 1
    assert ref_peak - peak >= (layers - 2) * x_bytes, (peak, ref_peak, x_bytes)


@pytest.mark.parametrize("mode", ["layer_input_checkpointed", "budget"])
def test_whole_step_peak_falls_with_swap(mode):
    """What a forward leaves held for its backward falls with swap (layer inputs: by the L-1
    swapped inputs), the whole step's peak never rises, and gradients are bitwise equal to the
    same compile without swap. Layer inputs: 6 checkpointed layers; budget mode: 3 plain layers
    at half the predicted peak, where the step's peak falls by a fifth.

    With layer inputs the step's peak falls only where it lies while layer inputs are held (see
    docs/graph.md, "What it saves"). A partitioner that saves an RNG state per checkpointed layer
    (torch 2.13, for SDPA even at ``dropout_p=0``) holds them into the backward and puts the peak
    of this tiny model there: it falls by at least (L-2)/2 inputs. Without them (torch 2.14 and
    later) the peak is at the end of the backward, where every layer's parameter gradients (here
    as large as a layer input) and no layer input are held: swap cannot lower it."""
    layers, recompute, seq = (6, True, 64) if mode != "budget" else (3, False, 32)
    model = tiny_model(layers, recompute=recompute)
    ref = twin(model)
    backend = (make_swap_backend("aot_eager") if mode != "budget" else
               make_swap_backend("aot_eager", memory_budget=0.5, cost_model=FAST))
    swap_pass.reset()
    held, peak = _held_and_peak(model, backend, seq)
    ref_held, ref_peak = _held_and_peak(ref, "aot_eager", seq)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    part = backend.partitions[-1]
    assert part.swapped and peak <= ref_peak, (peak, ref_peak)
    if mode == "budget":
        assert held < ref_held and peak < 0.8 * ref_peak, (held, ref_held, peak, ref_peak)
        return
    x_bytes = part.swapped[0].nbytes
    assert len(part.swapped) == layers - 1
    assert ref_held - held >= (layers - 1) * x_bytes, (held, ref_held, x_bytes)
    if _saves_rng_state(part.forward):
        assert ref_peak - peak >= (layers - 2) * x_bytes // 2, (peak, ref_peak, x_bytes)


# --- ops that return tuples -------------------------------------------------------------------


@pytest.fixture
def cpu_flash_attention_counted(monkeypatch):
    """``flop_registry`` as torch 2.15 ships it: the CPU flash-attention kernels (which return
    ``(output, logsumexp, ...)`` tuples, like the CUDA attention kernels registered since 2.13)
    count as matmul-class compute. On a release that already has them this changes nothing."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    for name, _like in (("_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_flash_attention"),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward",
                         "_scaled_dot_product_flash_attention_backward")):
        if hasattr(aten, name) and getattr(aten, name) not in flop_registry:
            monkeypatch.setitem(flop_registry, getattr(aten, name), lambda *a, **k: 1 << 20)
    return flop_registry


@pytest.mark.parametrize("mode", ["budget", "layer_input"])
def test_prefetch_and_wait_depend_on_one_tensor_when_attention_returns_a_tuple(
        cpu_flash_attention_counted, mode):
    """Attention in ``flop_registry`` returns a tuple: every ``after`` argument is still a single
    tensor (the tuple's ``getitem`` or an earlier matmul), the step runs and is bitwise equal."""
    model = tiny_model(3)
    ref = twin(model)
    backend = (make_swap_backend("aot_eager", memory_budget=0.5, cost_model=FAST)
               if mode == "budget" else make_swap_backend("aot_eager"))
    swap_pass.reset()
    _compile_and_step(model, backend)
    _compile_and_step(ref, "aot_eager")
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    part = backend.partitions[-1]
    assert part.swapped
    ops = (OPS.wait.default, OPS.prefetch.default)
    tuple_deps = 0
    graphs = (part.forward, part.backward)
    assert any("flash_attention" in str(n.target) for gm in graphs for n in gm.graph.nodes)
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.target in ops and len(n.args) > (2 if n.target == OPS.wait.default else 5):
                after = n.args[-1]
                assert isinstance(after.meta["val"], torch.Tensor), (n, after)
                tuple_deps += after.target is __import__("operator").getitem
    assert swap_pass.swap_stats().swapped_out_bytes == _bytes_spanned(part)
    if mode == "budget":  # waits placed anywhere: some follow an attention kernel directly
        assert tuple_deps, "some wait or prefetch should follow an attention kernel's output"


# --- dynamic shapes ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two dynamic-shape compiles of each model
@pytest.mark.parametrize("dynamic", [True, None])
def test_budget_mode_plans_with_size_hints_under_dynamic_shapes(dynamic):
    """Symbolic sizes are planned with their hints (Note: [Planning with symbolic sizes]):
    ``dynamic=True`` from the first step, and the default's automatic dynamic recompile at the
    second sequence length, both swap, and every step is bitwise equal to the same compile
    without swap."""
    model = tiny_model(3)
    ref = twin(model)
    backend = make_swap_backend("aot_eager", memory_budget=0.5, cost_model=FAST)
    swap_pass.reset()
    runs = []
    for m, b in ((model, backend), (ref, "aot_eager")):
        torch._dynamo.reset()
        compiled = torch.compile(m, backend=b, fullgraph=True, dynamic=dynamic)
        runs.append([compiled(*batch(m, seq)) for seq in (8, 12)])
        for loss in runs[-1]:
            loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    part = backend.partitions[-1]
    symbolic = [n for n in part.forward.graph.find_nodes(op="placeholder")
                if isinstance(n.meta.get("val"), torch.Tensor)
                and not all(isinstance(d, int) for d in n.meta["val"].shape)]
    assert symbolic, "the last graph should have symbolic sizes"
    assert part.swapped and part.predicted_peak < part.predicted_peak_without_swap
    swaps = [n for n in part.forward.graph.nodes if n.target == OPS.swap_out.default]
    assert len(swaps) == len(part.swapped)
    assert swap_pass.swap_stats().host_bytes_in_use == 0
