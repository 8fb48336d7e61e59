"""The stream races of tests/*/test_races.py on a real CUDA device, with the side streams slowed.

Each copy issued on a side stream is preceded by ``torch.cuda._sleep`` on that same stream, so
a reader that is not ordered after the copy runs first and reads the data the copy has not
written yet; the compute stream is never slowed (that would hide consumer-side races). Every
side-stream copy must have a pinned host side: a pageable copy blocks the host until the side
stream drains, which would hide the races the sleeps open. Layer inputs are 64 MiB, three or more
steps run so pooled host buffers are reused, and a second stream (and a second device where
present) takes part. The compiled paths (``swap_backend`` with Inductor, and with aot_eager on a
retained graph) run their swap ops for real under the same slowed streams;
``compile_layers(mode="reduce-overhead")`` with swap is refused, and runs without it.

The last test runs one eager step under ``TORCH_CUDA_SANITIZER=1`` in a child process and checks
that it swapped. Only an eager path is worth it there: under the sanitizer ``torch.compile`` runs
the model eagerly (the sanitizer is a dispatch mode, and Dynamo skips frames while one is
active), so no compiled swap op executes; and the sanitizer does not check a free against a
side-stream read still pending, the races the slowed streams above catch.

This file tests CUDA itself: it calls ``torch.cuda`` directly (``_sleep``, streams, the
sanitizer), which device-generic library code never does. Run by ``scripts/gpu_check.sh``.

Why these bodies are not shared with the test accelerator (``swaptest``,
``swap_pass.testing.load_test_accelerator``): there every side-stream copy is already held back
by the device's own seeded delay (``swap_pass.testing.accelerator.set_delay``, on by default), so
the slowed-side-stream cases are the device-parametrized tests themselves: the same layer-input
races at small sizes in ``tests/eager/test_races.py``, ``tests/runtime``, the compiled path
(aot_eager) in ``tests/graph``, SmartSwap in ``tests/smart``, two threads in
``tests/reliability/test_threads.py``, run on CUDA too by the ``accelerator`` stage of
``scripts/gpu_check.sh``. What is left here has no counterpart on that device: its compute runs
on the calling thread, never late, so a producer slowed by ``torch.cuda._sleep`` on the compute
stream cannot be modelled; Inductor cannot generate code for it; CUDA graphs
(``reduce-overhead``), the sanitizer and ``torch.cuda.host_memory_stats`` are CUDA's; and 64 MiB
layer inputs over several steps, sized against a real device's bandwidth, would only make a
CPU-backed device slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.runtime.device import DeviceStreams

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device; this machine has none"),
]

HIDDEN, TOKENS = 4096, 4096  # one layer input: 4096 x 4096 float32 = 64 MiB
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than any of these layers' kernels
STEPS = 3


@pytest.fixture
def slow_side_streams(monkeypatch):
    """Queue a sleep on the side stream before every copy the runtime issues there; yields the
    list of those copies' host sides, each ``(nbytes, is_pinned)``."""
    copy = DeviceStreams.copy
    side_copies: list[tuple[int, bool]] = []

    def slowed(self, stream, dst, src, *args, **kwargs):
        if stream is not None and stream != torch.cuda.current_stream(self.device):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
            side_copies.append(_host_side(dst, src))
        copy(self, stream, dst, src, *args, **kwargs)

    monkeypatch.setattr(DeviceStreams, "copy", slowed)
    yield side_copies


def _host_side(dst, src) -> tuple[int, bool]:
    host = dst if dst.device.type == "cpu" else src
    nbytes = host.nbytes if isinstance(host, torch.Tensor) else host.nbytes()
    return nbytes, host.is_pinned()


def _assert_slowed_and_pinned(side_copies, min_copies=1):
    """The side streams were slowed before enough copies, and every one had a pinned host side."""
    assert len(side_copies) >= min_copies, side_copies
    pageable = [c for c in side_copies if not c[1]]
    assert not pageable, f"{len(pageable)} side-stream copies from pageable memory: {pageable[:3]}"


class Block(torch.nn.Module):
    def __init__(self, passthrough: bool = False, slow: bool = False) -> None:
        super().__init__()
        self.passthrough = passthrough  # returns its input: one storage in two groups
        self.slow = slow  # the compute stream sleeps before producing the output
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        if self.slow:  # the next layer's swap-out must wait for this producer (producer wait)
            torch.cuda._sleep(SLEEP_CYCLES)
        return x if self.passthrough else x + self.fc(torch.tanh(self.norm(x)))


class Stack(torch.nn.Module):
    """Four blocks; ``mode`` picks the interleaving the race needs."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.layers = torch.nn.ModuleList(
            Block(mode == "identity" and i == 1, mode == "slow_producer") for i in range(4))
        self.alpha = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        if self.mode == "checkpointed":  # each layer keeps only its input (full recompute)
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x.pow(2).mean()
        if self.mode == "segment":  # one checkpoint around two swapped layers
            h = checkpoint(lambda t: self.layers[1](self.layers[0](t)), x, use_reentrant=False)
            h = checkpoint(lambda t: self.layers[3](self.layers[2](t)), h, use_reentrant=False)
            return h.float().pow(2).mean()
        extra = 0
        for idx, layer in enumerate(self.layers):
            x_in = x
            x = layer(x)
            if self.mode == "alpha" and idx == 1:
                extra = (self.alpha * x_in).pow(2).mean()
        return x.pow(2).mean() + extra


def _steps(model, data, stream=None, sync_each_step=True):
    out = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            loss = model(data[step])
            loss.backward()
            out.append((loss.detach().clone(), _grads(model)))
        if sync_each_step:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return out


def _grads(model):
    """Each parameter's gradient, cloned; None for a parameter the step did not use (``alpha``
    outside its mode)."""
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _equal(a, b) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def _assert_same(ref, got):
    for (rl, rg), (gl, gg) in zip(ref, got, strict=True):
        assert torch.equal(rl, gl)
        for a, b in zip(rg, gg, strict=True):
            assert _equal(a, b)


@pytest.mark.parametrize("mode", ["segment", "alpha", "identity", "plain"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_eager_exact_with_slow_side_streams(slow_side_streams, mode, prefetch):
    torch.manual_seed(0)
    ref = Stack(mode).cuda()
    model = Stack(mode).cuda()
    model.load_state_dict(ref.state_dict())
    data = [torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True) for _ in range(STEPS)]
    expected = _steps(ref, data)
    with swap_pass.enable_swap_layer_input(model, config=swap_pass.SwapConfig(prefetch=prefetch)):
        got = _steps(model, data)
        other = torch.cuda.Stream()  # the same steps with another compute stream: pooled reuse
        got_other = _steps(model, data, other)
    _assert_same(expected, got)
    _assert_same(expected, got_other)
    assert swap_pass.swap_stats().peak_device_bytes_released >= TOKENS * HIDDEN * 4
    _assert_slowed_and_pinned(slow_side_streams, min_copies=STEPS)


@pytest.mark.parametrize("slow", ["compute", "side"])
def test_eager_exact_without_a_per_step_synchronize(slow_side_streams, slow, monkeypatch):
    """No synchronize between steps; the compute stream sleeps before every producer (a missing
    producer wait copies data not yet written) or the side streams sleep before every copy."""
    if slow == "compute":
        monkeypatch.undo()  # side streams at full speed: only the producers are late
    torch.manual_seed(0)
    mode = "slow_producer" if slow == "compute" else "plain"
    ref, model = Stack(mode).cuda(), Stack(mode).cuda()
    model.load_state_dict(ref.state_dict())
    data = [torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True) for _ in range(STEPS)]
    expected = _steps(ref, data)
    with swap_pass.enable_swap_layer_input(model):
        got = _steps(model, data, sync_each_step=False)
    _assert_same(expected, got)
    assert swap_pass.swap_stats().swap_outs >= STEPS
    if slow == "side":
        _assert_slowed_and_pinned(slow_side_streams, min_copies=STEPS)


def test_two_devices_interleaved_without_synchronize(slow_side_streams):
    """Steps alternate between two devices with no synchronize: buffers one device gives back
    are taken by the other's swap-outs, which must wait on the buffers' last copies."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices; this machine has one")
    models, data, refs = [], [], []
    for dev in ("cuda:0", "cuda:1"):
        torch.manual_seed(0)
        model = Stack("plain").to(dev)
        batch = [torch.randn(TOKENS, HIDDEN, device=dev, requires_grad=True) for _ in range(STEPS)]
        with torch.cuda.device(dev):
            refs.append(_steps(model, batch))
        models.append(model)
        data.append(batch)
    got = [[], []]
    with swap_pass.enable_swap_layer_input(models[0]), swap_pass.enable_swap_layer_input(models[1]):
        for step in range(STEPS):
            for i, dev in enumerate(("cuda:0", "cuda:1")):
                with torch.cuda.device(dev):
                    models[i].zero_grad(set_to_none=True)
                    loss = models[i](data[i][step])
                    loss.backward()
                    got[i].append((loss.detach().clone(),
                                   _grads(models[i])))
    for dev in ("cuda:0", "cuda:1"):
        torch.cuda.synchronize(dev)
    for ref, mine in zip(refs, got, strict=True):
        _assert_same(ref, mine)


def _compiled_steps(model, data, forward, mark_steps=False):
    """STEPS steps of ``forward`` with no synchronize between them; losses and gradients."""
    out = []
    for step in range(STEPS):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        loss = forward(data[step])
        loss.backward()
        out.append((loss.detach().clone(), _grads(model)))
    torch.cuda.synchronize()
    return out


def _stack_and_data(mode="plain"):
    torch.manual_seed(0)
    model = Stack(mode).cuda()
    data = [torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True) for _ in range(STEPS)]
    return model, data


def test_compiled_exact_with_slow_side_streams(slow_side_streams):
    """swap_backend's swap_out / prefetch / wait ops run in Inductor's graphs with the side
    streams slowed, steps back to back: the same losses and gradients as the same compile
    without swap (aot_eager: the retained-graph test below). The layers are checkpointed, so the
    graph saves their inputs, which Inductor's partitioner would otherwise not keep."""
    inner = "inductor"
    model, data = _stack_and_data("checkpointed")
    torch._dynamo.reset()
    expected = _compiled_steps(model, data, torch.compile(model, backend=inner))
    swap_pass.reset()
    slow_side_streams.clear()
    torch._dynamo.reset()
    got = _compiled_steps(model, data,
                          torch.compile(model, backend=swap_pass.make_swap_backend(inner)))
    _assert_same(expected, got)
    stats = swap_pass.swap_stats()
    assert stats.swap_outs >= STEPS and stats.swap_ins >= STEPS, stats
    _assert_slowed_and_pinned(slow_side_streams, min_copies=STEPS)


def test_reduce_overhead_compiled_layers_are_refused_with_swap_and_run_without():
    """compile_layers(mode="reduce-overhead") with swap is refused before the first step, the
    error naming the mode (cudagraph trees' outputs live in their private pool: a swap would
    free and restore them outside it); without swap the same compile trains."""
    model, data = _stack_and_data()
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="reduce-overhead"):
        swap_pass.compile_layers(model, swap=True, mode="reduce-overhead")
    torch._dynamo.reset()
    with swap_pass.compile_layers(model, swap=False, mode="reduce-overhead"):
        steps = _compiled_steps(model, data, model, mark_steps=True)
    assert all(torch.isfinite(loss).all() for loss, _ in steps)
    assert swap_pass.swap_stats().swap_outs == 0


def test_reset_returns_pinned_memory():
    """Pinned host bytes of the pool go back to the OS on reset()
    (torch.accelerator.empty_host_cache)."""
    if not hasattr(torch.accelerator, "empty_host_cache"):
        pytest.skip("this torch has no torch.accelerator.empty_host_cache")
    torch.manual_seed(0)
    model = Stack("plain").cuda()
    data = [torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True) for _ in range(STEPS)]
    with swap_pass.enable_swap_layer_input(model):
        _steps(model, data)
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    swap_pass.reset()
    left = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    report = f"pinned host bytes: {held} after 3 steps, {left} after swap_pass.reset()"
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pinned.txt"), "w") as f:
            f.write(report + "\n")
    assert held >= TOKENS * HIDDEN * 4 and left == 0, report


def test_two_devices_share_the_pool(slow_side_streams):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices; this machine has one")
    results = []
    for dev in ("cuda:0", "cuda:1"):
        torch.manual_seed(0)
        model = Stack("plain").to(dev)
        data = [torch.randn(TOKENS, HIDDEN, device=dev, requires_grad=True) for _ in range(STEPS)]
        with torch.cuda.device(dev):
            ref = _steps(model, data)
            with swap_pass.enable_swap_layer_input(model):
                got = _steps(model, data)
        _assert_same(ref, got)
        results.append(got)


def test_retained_graph_compiled_with_slow_side_streams(slow_side_streams):
    """A compiled graph kept with retain_graph=True while later steps take the pooled host
    buffers; its second backward still reads its own data."""

    def run(backend):
        model, data = _stack_and_data()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        loss = compiled(data[0])
        loss.backward(retain_graph=True)
        for step in range(1, STEPS):  # new forwards take the pooled host buffers
            compiled(data[step]).backward()
        loss.backward()
        torch.cuda.synchronize()
        return _grads(model)

    ref = run("aot_eager")
    swap_pass.reset()
    slow_side_streams.clear()
    got = run(swap_pass.make_swap_backend("aot_eager"))
    for a, b in zip(ref, got, strict=True):
        assert _equal(a, b)
    _assert_slowed_and_pinned(slow_side_streams, min_copies=STEPS)


_SANITIZED_STEP = textwrap.dedent("""
    import torch, swap_pass
    import torch.cuda._sanitizer as csan
    from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch
    assert csan.cuda_sanitizer.enabled, "TORCH_CUDA_SANITIZER=1 did not turn the sanitizer on"
    cfg = LlamaConfig(hidden_size=256, num_layers=3, num_heads=4, intermediate_size=512,
                      vocab_size=128)
    model = LlamaStyleModel(cfg, recompute=True).cuda()
    ids, labels = make_batch(cfg, 2, 128, device="cuda")
    with swap_pass.enable_swap_layer_input(model):
        for _ in range(2):
            model(ids, labels).backward()
    torch.cuda.synchronize()
    print("swap_outs", swap_pass.swap_stats().swap_outs)
""")


def test_one_eager_step_under_the_cuda_sanitizer():
    """CSAN reports any kernel pair on two streams touching one tensor without an event between;
    the step must have swapped for that to mean anything."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run([sys.executable, "-c", _SANITIZED_STEP], env=env, capture_output=True,
                          text=True, timeout=25)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert "CSAN" not in proc.stderr, tail
    swap_outs = int(proc.stdout.split("swap_outs")[-1].split()[0])
    assert swap_outs > 0, tail
