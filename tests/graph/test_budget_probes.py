"""Budget mode's cost probes: real tensors inside ``torch.compile``, once per process, and never
when the user's CostModel gives both rates.

See Note: [Probes run on real tensors], Note: [Measured rates] and Note: [Throughput probe] in
``swap_pass/cost/probes.py``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import swap_pass.cost.probes as probes
import swap_pass.graph.budget as budget
from swap_pass import make_swap_backend
from swap_pass.graph.budget import Budget, CostModel, choose_swaps, matmul_dtype
from tests.conftest import ACCELERATOR, HAS_ACCELERATOR, NO_ACCELERATOR_REASON

from .helpers import batch, tiny_model

CPU = torch.device("cpu")
PROBES = ("measure_copy_bandwidth", "measure_flops")


@dataclasses.dataclass
class ProbeSpy:
    """What the probes did: each probe call, with whether the compiler's fake mode was active
    where it was called, and every tensor a timed call produced (type, dtype, shape)."""

    calls: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    timed: list[tuple[type, torch.dtype, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    plans: list[CostModel] = dataclasses.field(default_factory=list)

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)


@pytest.fixture
def spy(monkeypatch) -> ProbeSpy:
    """A :class:`ProbeSpy` on a process with no rate measured yet (and none left behind)."""
    seen = ProbeSpy()
    for name in PROBES:
        monkeypatch.setattr(probes, name, _spy_probe(seen, name, getattr(probes, name)))
    real_time = probes.time_on_device

    def time_on_device(fn, device, timing=None):
        def timed():
            out = fn()
            seen.timed.append((type(out), out.dtype, tuple(out.shape)))
            return out
        return real_time(timed, device, timing)

    monkeypatch.setattr(probes, "time_on_device", time_on_device)
    real_timeline = budget._timeline

    def timeline(fw, bw, cost):  # the rates the plan is made with
        seen.plans.append(cost)
        return real_timeline(fw, bw, cost)

    monkeypatch.setattr(budget, "_timeline", timeline)
    probes.clear_measured_rates()
    yield seen
    probes.clear_measured_rates()


def _spy_probe(seen: ProbeSpy, name: str, probe):
    def wrapper(*args, **kwargs):
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        seen.calls.append((name, fake))
        return probe(*args, **kwargs)
    return wrapper


def _compile_budget_step(cost_model: CostModel | None = None, layers: int = 3) -> None:
    model = tiny_model(layers)
    backend = make_swap_backend("aot_eager", memory_budget=0.5, cost_model=cost_model)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "memory_budget not reached": the plan is not tested here
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        compiled(*batch(model)).backward()


# --- real tensors -------------------------------------------------------------------------------


def test_probes_inside_compile_time_real_tensors(spy):
    """The partitioner runs under AOTAutograd's FakeTensorMode; the probes it triggers still
    multiply and copy real tensors (Note: [Probes run on real tensors])."""
    _compile_budget_step()
    assert spy.count("measure_copy_bandwidth") == 1 and spy.count("measure_flops") == 1
    assert all(fake for _, fake in spy.calls), "the probes should be triggered under the fake mode"
    n = probes.probe_side(CPU)
    assert spy.timed.count((torch.Tensor, torch.float32, (n, n))) == 4  # one warm-up, three timed
    assert spy.timed.count((torch.Tensor, torch.uint8, (16 << 20,))) == 3
    assert len(spy.timed) == 7


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_probe_under_a_fake_or_dispatch_mode_escapes_it(spy):
    """Called directly under a FakeTensorMode or a user's dispatch mode, the probes time real
    tensors and the mode sees none of their ops."""
    with FakeTensorMode():
        assert probes.measure_flops(CPU, n=64, repeats=1) > 0
        assert probes.measure_copy_bandwidth(CPU, nbytes=1 << 16, repeats=1) > 0
    with _Recording() as recording:
        probes.measure_flops(CPU, n=64, repeats=1)
    assert recording.ops == []
    assert {t for t, _, _ in spy.timed} == {torch.Tensor} and len(spy.timed) == 5


def test_a_probe_that_gets_no_real_tensors_raises(monkeypatch):
    import contextlib

    monkeypatch.setattr(probes, "real_tensors", contextlib.nullcontext)
    with FakeTensorMode(), pytest.raises(RuntimeError, match=(
            r"swap_pass\.measure_flops: the probe's tensors are \['FakeTensor'\], not plain "
            r"tensors, although the compiler's modes were unset\. A cost probe must time")):
        probes.measure_flops(CPU, n=8, repeats=1)


def _best(probe, runs: int = 3) -> tuple[float, float]:
    rates = [probe() for _ in range(runs)]
    return min(rates), max(rates)


def test_rates_planned_inside_compile_match_the_probe_outside(spy):
    """What budget mode plans with during a compile is within 3x of the same probes run here
    (FakeTensors made them 10-100x too fast). Outside runs before and after bound the noise of
    a shared machine: the planned rate lies within 3x of their range."""
    outside = [_best(lambda: probes.measure_flops(CPU)),
               _best(lambda: probes.measure_copy_bandwidth(CPU))]
    _compile_budget_step()
    later = [_best(lambda: probes.measure_flops(CPU)),
             _best(lambda: probes.measure_copy_bandwidth(CPU))]
    (plan,) = spy.plans
    for used, (lo, hi), (lo2, hi2) in zip((plan.flops_per_s, plan.copy_bytes_per_s), outside,
                                          later, strict=True):
        lo, hi = min(lo, lo2), max(hi, hi2)
        assert lo / 3 <= used <= 3 * hi, (used, lo, hi)


# --- once per process ---------------------------------------------------------------------------


def test_a_second_compile_does_not_probe_again(spy):
    _compile_budget_step()
    first = list(spy.calls)
    _compile_budget_step(layers=2)  # another model, another graph: same device and dtype
    assert spy.calls == first and len(first) == 2
    assert len(spy.plans) == 2 and spy.plans[0] == spy.plans[1]
    ((copy_key, copy), (flops_key, flops)) = sorted(probes.measured_rates().items(),
                                                    key=lambda kv: kv[0][0])
    assert copy_key[:3] == ("copy", CPU, None) and copy == spy.plans[0].copy_bytes_per_s
    assert flops_key[:3] == ("flops", CPU, torch.float32) and flops == spy.plans[0].flops_per_s


def test_swap_pass_reset_keeps_the_measured_rates(spy):
    import swap_pass

    probes.flop_rate(CPU)
    swap_pass.reset()
    probes.flop_rate(CPU)
    assert spy.count("measure_flops") == 1


def test_threads_that_miss_at_once_probe_once(spy, monkeypatch):
    real = probes.measure_flops

    def slow(*args, **kwargs):  # long enough for the other thread to find the probe running
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(probes, "measure_flops", slow)
    out: list[float] = []
    threads = [threading.Thread(target=lambda: out.append(probes.flop_rate(CPU)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert spy.count("measure_flops") == 1 and len(out) == 2 and out[0] == out[1]


# --- a given CostModel wins ---------------------------------------------------------------------


def test_a_given_cost_model_runs_no_probe(spy):
    given = CostModel(copy_bytes_per_s=3e9, flops_per_s=4e10)
    _compile_budget_step(given)
    assert spy.calls == [] and spy.timed == [] and probes.measured_rates() == {}
    assert spy.plans == [given]


def test_a_given_copy_rate_measures_only_the_flop_rate(spy):
    _compile_budget_step(CostModel(copy_bytes_per_s=3e9))
    assert [name for name, _ in spy.calls] == ["measure_flops"]
    assert spy.plans[0].copy_bytes_per_s == 3e9


# --- the matmul's dtype and side ----------------------------------------------------------------


def _bf16_graph() -> torch.fx.GraphModule:
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
    return make_fx(lambda x, w: (x @ w).sin(), tracing_mode="fake")(x, w)


def test_the_flops_probe_runs_in_the_graphs_matmul_dtype_at_the_probe_side(spy):
    """Note: [Throughput probe]: a bf16 graph is planned with the FLOP rate of bf16 matmuls, of
    the side chosen for the device."""
    fw, bw = _bf16_graph(), _bf16_graph()
    assert matmul_dtype(fw) is torch.bfloat16
    n = probes.probe_side(CPU)
    choose_swaps(fw, bw, [], Budget(1.0), CostModel(copy_bytes_per_s=1e12))
    assert spy.timed == [(torch.Tensor, torch.bfloat16, (n, n))] * 4  # one warm-up, three timed


def test_a_given_flops_rate_is_not_measured(spy):
    fw, bw = _bf16_graph(), _bf16_graph()
    choose_swaps(fw, bw, [], Budget(1.0), CostModel(copy_bytes_per_s=1e12, flops_per_s=1e12))
    assert spy.calls == [] and spy.timed == []


@pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)
def test_the_flops_probe_on_an_accelerator_times_bf16_at_its_side(spy):
    device = torch.device(ACCELERATOR)
    n = probes.probe_side(device)
    assert n == 4096
    flops = probes.measure_flops(device, torch.bfloat16)
    assert spy.timed == [(torch.Tensor, torch.bfloat16, (n, n))] * 4 and flops > 0


@pytest.mark.skipif(not HAS_ACCELERATOR, reason=NO_ACCELERATOR_REASON)
def test_probes_inside_compile_on_an_accelerator_time_real_tensors(spy):
    model = tiny_model(3, device=ACCELERATOR)
    backend = make_swap_backend("aot_eager", memory_budget=0.5)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=backend, fullgraph=True)(*batch(model)).backward()
    assert spy.count("measure_flops") == 1 and spy.timed
    assert {t for t, _, _ in spy.timed} == {torch.Tensor}
