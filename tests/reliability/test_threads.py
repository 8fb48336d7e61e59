"""Two models, each under its own ``module_tag``, trained in two threads at once.

Each thread trains its own swapped model; a barrier starts every step of both threads together,
so the two models' swap-outs, frees and swap-ins interleave on the shared host pool and stats.
The no-swap references are trained beforehand on the main thread. See docs/reliability.md for
what is and is not thread-safe.
"""

from __future__ import annotations

import threading
import time

import pytest
from torch import nn

import swap_pass
from swap_pass.tools.models import LlamaDecoderLayer
from tests.eager.helpers import assert_clean, assert_exact, batch, train_step, twin
from tests.reliability.helpers import CFG, SWAPPED_LAYERS, InputProbe, input_bytes, model_pair, sgd

STEPS = 8


def _decorated_layer(tag: str) -> type[nn.Module]:
    """The tiny Llama layer decorated MindSpeed-style, its managers under ``tag``."""

    class Layer(LlamaDecoderLayer):
        swap_module_tag = tag

        @swap_pass.swap_layer_input_init_wrapper
        def __init__(self, cfg):
            super().__init__(cfg)

        @swap_pass.swap_layer_input_forward_wrapper
        def forward(self, hidden_states, cos, sin):
            return super().forward(hidden_states, cos, sin)

    return Layer


def _swapped_twin(ref, recompute: bool, path: str, tag: str) -> nn.Module:
    def build():
        m = type(ref)(CFG, recompute=recompute)
        if path == "decorators":
            m.layers = nn.ModuleList(_decorated_layer(tag)(CFG) for _ in range(CFG.num_layers))
        return m

    model = twin(ref, build).to(ref.cos_table.device)
    if path == "enable":
        swap_pass.enable_swap_layer_input(model)
    return model


def _sgd_step(model, b):
    result = train_step(model, b)
    sgd(model)
    return result


class _Trainer(threading.Thread):
    """Trains one swapped model ``STEPS`` steps, each started together with the other thread."""

    def __init__(self, model, seed: int, barrier: threading.Barrier) -> None:
        super().__init__(name=f"trainer-{seed}")
        self.model, self.seed, self.barrier = model, seed, barrier
        self.results, self.resident, self.intervals = [], [], []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for step in range(STEPS):
                self.barrier.wait(timeout=60)
                start = time.perf_counter()
                b = batch(CFG, seed=self.seed * 100 + step, device=self.model.cos_table.device)
                self.results.append(self._step(b))
                self.intervals.append((start, time.perf_counter()))
        except BaseException as err:  # re-raised on the main thread
            self.error = err
            self.barrier.abort()

    def _step(self, b):
        self.model.zero_grad(set_to_none=True)
        with InputProbe(self.model) as probe:
            loss = self.model(*b)
        self.resident.append(probe.resident_bytes())
        loss.backward()
        result = (loss.detach(), {n: p.grad.clone() for n, p in self.model.named_parameters()})
        sgd(self.model)
        return result


def _overlapping(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> int:
    return sum(1 for (a0, a1), (b0, b1) in zip(a, b, strict=True) if a0 < b1 and b0 < a1)


# On the test accelerator both threads queue their work on the device's one default stream; each
# thread's copies must wait on that thread's own work there.
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("path", ["enable", "decorators"])
def test_two_models_in_two_threads_exact_and_clean(path, recompute, device):
    pairs = [model_pair(recompute, seed=seed, device=device) for seed in (1, 2)]
    models = [_swapped_twin(ref, recompute, path, f"rel.thread{i}")
              for i, (ref, _) in enumerate(pairs)]
    tags = set(swap_pass.SwapLayerInputManager.manager_map)
    managers = swap_pass.SwapLayerInputManager.managers
    assert len(tags) == 2 and all(len(managers(t)) == CFG.num_layers for t in tags)
    expected = [[_sgd_step(ref, batch(CFG, seed=seed * 100 + step, device=device))
                 for step in range(STEPS)]
                for seed, (ref, _) in zip((1, 2), pairs, strict=True)]
    barrier = threading.Barrier(2)
    trainers = [_Trainer(model, seed, barrier)
                for seed, model in zip((1, 2), models, strict=True)]
    for t in trainers:
        t.start()
    for t in trainers:
        t.join(timeout=120)
    for t in trainers:
        assert not t.is_alive(), f"{t.name} hung"
        if t.error is not None:
            raise t.error
    for t, exp in zip(trainers, expected, strict=True):
        for _step, (e, got) in enumerate(zip(exp, t.results, strict=True)):
            assert_exact(e, got)
        # Every input but the last was freed on the device between forward and backward.
        assert t.resident == [[0] * SWAPPED_LAYERS + [input_bytes(2, 8)]] * STEPS
    assert _overlapping(*(t.intervals for t in trainers)) > 0  # the steps really ran together
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == 2 * STEPS * SWAPPED_LAYERS
    assert stats.peak_host_bytes_in_use <= 2 * SWAPPED_LAYERS * input_bytes(2, 8)
    assert_clean()
