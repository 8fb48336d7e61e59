"""Under Inductor the tensor a ``swap_out`` copy reads lives, in one buffer, until its ``wait``.

Note: [One buffer from swap_out to wait] in ``swap_pass/graph/aot_pass.py``. Each test trains two
steps (the first compiles) and watches the second: every swapped source must die only after its
wait ran (a source that dies before it makes the compute stream wait for the copy at once: no
overlap; one whose buffer Inductor hands to a later kernel before the wait corrupts the copy on
an asynchronous device). Gradients are bitwise equal to the same compile without swap, on CPU
and on the test accelerator, whose C++ kernels Inductor generates and runs in stream order.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import swap_pass
import swap_pass.graph.ops as ops
from swap_pass import make_swap_backend
from swap_pass.graph.budget import CostModel
from swap_pass.sac import has_offload_policies
from swap_pass.tools.bench.measure import warm_step_peak
from tests.conftest import DEVICES

from .helpers import (
    batch,
    skip_inductor_on_the_test_accelerator,
    swap_out_sources_died,
    tiny_model,
    twin,
)

pytestmark = pytest.mark.slow  # Inductor compiles: tens of seconds each on 2 cores

L = 3
FAST = CostModel(copy_bytes_per_s=1e12, flops_per_s=1e12)  # budget mode's choice by bytes


@pytest.fixture(params=DEVICES)
def inductor_device(request) -> torch.device:
    device = torch.device(request.param)
    skip_inductor_on_the_test_accelerator(device)
    return device


def _order_counters(device: torch.device) -> dict[str, int]:
    """The test accelerator's order-check counters (empty on CPU)."""
    from swap_pass.testing import accelerator as device_knobs

    if device.type != device_knobs.DEVICE_TYPE:
        return {}
    return device_knobs.order_counters(device.index or 0)


def _llama(device, recompute):
    model = tiny_model(L, recompute=recompute, device=device)
    return model, lambda: batch(model)


def _sac_stack(device):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from tests.test_sac import Stack, _input, _policy

    model = Stack(functools.partial(create_selective_checkpoint_contexts,
                                    _policy("MUST_CPU_OFFLOAD"))).to(device)
    x = _input().to(device)
    return model, lambda: (x,)


def _model(mode: str, device: torch.device):
    if mode == "sac_tags":
        if not has_offload_policies():
            pytest.skip(f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD")
        return _sac_stack(device)
    return _llama(device, recompute=mode == "layer_input")


def _backend(mode: str):
    if mode == "budget":
        return make_swap_backend(memory_budget=0.5, cost_model=FAST)
    return make_swap_backend()  # inductor; sac_tags: the tags choose


def _step(compiled, model, inputs):
    model.zero_grad(set_to_none=True)
    loss = compiled(*inputs())
    loss.backward()
    return loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


def _two_steps(model, inputs, backend):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    return [_step(compiled, model, inputs) for _ in range(2)]


@pytest.mark.parametrize("mode", ["layer_input", "budget", "sac_tags"])
def test_every_swap_out_source_dies_after_its_wait(mode, inductor_device, deterministic,
                                                   monkeypatch):
    model, inputs = _model(mode, inductor_device)
    ref_model = twin(model)
    deaths, died = swap_out_sources_died()
    monkeypatch.setattr(ops, "_source_died_unwaited", died)
    swap_pass.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_backend(mode), fullgraph=True)
    order_before = _order_counters(inductor_device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [_step(compiled, model, inputs)]
        deaths.clear()
        outs = swap_pass.swap_stats().swap_outs
        got.append(_step(compiled, model, inputs))
    swapped = swap_pass.swap_stats().swap_outs - outs
    assert swapped > 0
    assert deaths == [True] * swapped  # each died, and only after its wait
    # every wait kept the buffer its copy read (a second, recomputed keepalive warns on CPU and
    # raises on the device: Note: [The keepalive is the copy's source] in graph/ops.py)
    assert not [w for w in seen if "is not the one swap_out copied" in str(w.message)]
    # on the test accelerator: no kernel wrote a block a queued copy still read
    assert _order_counters(inductor_device) == order_before
    ref = _two_steps(ref_model, inputs, "inductor")
    for (loss, grads), (ref_loss, ref_grads) in zip(got, ref, strict=True):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_the_step_peak_does_not_rise_and_the_counter_sees_the_frees(deterministic):
    """CPU, layer-input mode on a checkpointed model: no extra buffer is recomputed to keep a
    source alive, so the profiled whole-step peak is not above the compile without swap; and
    ``peak_device_bytes_released`` counts the freed layer inputs (each source's own buffer dies
    after its wait, where the counter watches it)."""
    cpu = torch.device("cpu")
    model, inputs = _llama(cpu, recompute=True)
    ref_model = twin(model)
    peaks = {}
    for name, m, backend in (("swap", model, make_swap_backend()),
                             ("plain", ref_model, "inductor")):
        torch._dynamo.reset()
        compiled = torch.compile(m, backend=backend, fullgraph=True)
        swap_pass.reset()
        peaks[name] = warm_step_peak(cpu, lambda c=compiled, m=m: _step(c, m, inputs),
                                     lambda m=m: m.zero_grad(set_to_none=True))
        if name == "swap":
            released = swap_pass.swap_stats().peak_device_bytes_released
    assert peaks["swap"] <= peaks["plain"], peaks
    ids, _ = inputs()
    layer_input = ids.numel() * model.cfg.hidden_size * 4
    assert released >= (L - 1) * layer_input
