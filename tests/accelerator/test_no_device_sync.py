"""No call that can synchronize the device runs inside a steady-state step, on every way in.

``swap_pass.testing.no_device_sync`` counts the host waits the test accelerator sees (device,
stream and event synchronizes, blocking copies to the host, ``.item()``, ``elapsed_time``, which
stalls torch_npu) and ``torch.accelerator.empty_host_cache``. Each way in trains warm-up steps,
then steps under the spy: with one length, and with four lengths seen once before (so no step
compiles), with and without ``max_host_bytes`` (a cap that makes changing lengths evict cached
pinned buffers mid-step, which must drop them without returning pinned memory). Every step is
compared bitwise with the same model without swap.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import swap_pass
from swap_pass import SmartSwap, SmartSwapConfig, SwapConfig
from swap_pass.testing import accelerator as device_knobs
from swap_pass.testing import count_device_syncs, no_device_sync
from swap_pass.tools.models import LlamaConfig, LlamaDecoderLayer, LlamaStyleModel, make_batch
from tests.graph.helpers import TraceableLlama

from .conftest import needs_test_accelerator

pytestmark = needs_test_accelerator

CFG = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=2,
                  intermediate_size=96, max_seq_len=128)
BATCH = 2
FIXED = [64]
CHANGING = [48, 64, 80, 56]
# Four layer inputs of the longest length, pinned in power-of-two blocks, and a little more:
# the lengths' blocks together pass it, so a new length evicts cached ones.
CAP = 4 * 64 << 10


class DecoratedLayer(LlamaDecoderLayer):
    """The tiny Llama layer, decorated the MindSpeed way."""

    swap_module_tag = "tests.accelerator.no_device_sync"

    @swap_pass.swap_layer_input_init_wrapper
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)

    @swap_pass.swap_layer_input_forward_wrapper
    def forward(self, hidden_states, cos, sin):
        return super().forward(hidden_states, cos, sin)


def _model(dev, recompute: bool = True, layer_cls=None) -> LlamaStyleModel:
    torch.manual_seed(0)
    model = LlamaStyleModel(CFG, recompute=recompute)
    if layer_cls is not None:
        model.layers = torch.nn.ModuleList(layer_cls(CFG) for _ in range(CFG.num_layers))
    return model.to(dev)


def _inputs(model: LlamaStyleModel, seq: int, traced: bool):
    ids, labels = make_batch(model.cfg, BATCH, seq, device=model.embed.weight.device)
    if traced:
        return ids, model.cos_table[:seq], model.sin_table[:seq], labels
    return ids, labels


class Way:
    """A way in: ``run(inputs)`` is one swapped step's forward and backward, ``ref`` the model
    without swap, ``end_step()`` what the user calls between steps."""

    def __init__(self, name: str, dev: torch.device, config: SwapConfig) -> None:
        self.name, self.traced, self.close = name, name == "apply_swap_pass", lambda: None
        self.end_step = lambda: None
        if name == "decorators":
            model = _model(dev, layer_cls=DecoratedLayer)
            for layer in model.layers:
                layer.swap_manager.config = config
            self.ref = _model(dev)
            self.ref.load_state_dict(model.state_dict())
            self.forward = model
        else:
            model = _model(dev, recompute=name not in ("smartswap", "apply_swap_pass"))
            self.ref = copy.deepcopy(model)
            self.forward = self._build(name, model, config)
        self.model = model
        if self.traced:
            self.ref = TraceableLlama(self.ref)

    def _build(self, name: str, model: LlamaStyleModel, config: SwapConfig):
        if name == "enable":
            handle = swap_pass.enable_swap_layer_input(model, config=config)
            self.close = handle.remove
            return model
        if name == "apply_swap_pass":
            traced = torch.fx.symbolic_trace(TraceableLlama(model))
            return swap_pass.apply_swap_pass(traced, config=config)
        if name == "swap_backend":
            backend = swap_pass.make_swap_backend("aot_eager", config=config)
            return torch.compile(model, backend=backend, fullgraph=True)
        if name == "compile_layers":
            handle = swap_pass.compile_layers(model, "aot_eager", config=config)
            self.close = handle.remove
            return model
        smart = SmartSwap(model, memory_budget=0.3,
                          config=SmartSwapConfig(swap=config, warmup_steps=1))
        smart.__enter__()
        self.end_step = smart.step
        self.smart = smart
        self.close = lambda: smart.__exit__(None, None, None)
        return model

    def run(self, inputs) -> torch.Tensor:
        loss = self.forward(*inputs)
        loss.backward()
        return loss

    def check(self, loss: torch.Tensor, inputs) -> None:
        """Bitwise against the model without swap (outside the spy: it reads values)."""
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ref_loss = self.ref(*inputs)
            ref_loss.backward()
        assert torch.equal(loss.detach().cpu(), ref_loss.detach().cpu()), self.name
        ref_params = self.ref.parameters()
        for p, q in zip(self.model.parameters(), ref_params, strict=True):
            assert torch.equal(p.grad.cpu(), q.grad.cpu()), self.name
        self.model.zero_grad(set_to_none=True)
        self.ref.zero_grad(set_to_none=True)


WAYS = ["enable", "decorators", "apply_swap_pass", "swap_backend", "compile_layers", "smartswap"]


@pytest.mark.parametrize("lengths", [FIXED, CHANGING], ids=["one_length", "changing_lengths"])
@pytest.mark.parametrize("cap", [None, CAP], ids=["no_cap", "capped"])
@pytest.mark.parametrize("way", WAYS)
def test_a_steady_step_never_waits_for_the_device(way, cap, lengths, dev) -> None:
    swap_pass.reset()
    torch._dynamo.reset()
    if cap is not None and way == "smartswap":  # it swaps any saved tensor, not only inputs
        config = SwapConfig(max_host_bytes=4 * cap, on_host_exhausted="keep_on_device")
    else:
        config = SwapConfig(max_host_bytes=cap)
    w = Way(way, dev, config)
    exhausted = (pytest.warns(RuntimeWarning, match="host memory exhausted while swapping")
                 if cap is not None and way == "smartswap" else contextlib.nullcontext())
    with exhausted:
        try:
            batches = [_inputs(w.model, seq, w.traced) for seq in lengths]
            warmup = 3 if way == "smartswap" else 1  # SmartSwap: warm-up, plan, then follow
            for _ in range(warmup):
                for inputs in batches:
                    w.check(w.run(inputs), inputs)
                    w.end_step()
            outs_before = swap_pass.swap_stats().swap_outs
            order_before = device_knobs.order_counters()
            for inputs in batches:
                with no_device_sync(dev, f"a steady {way} step (lengths {lengths}, cap {cap})"):
                    loss = w.run(inputs)
                with count_device_syncs(dev) as between:
                    w.end_step()
                # SmartSwap reads one timed copy a step (Note: [One timed copy a step])
                assert between.calls.get("host_syncs", 0) == 0, between.calls
                assert between.calls.get("elapsed_time_calls", 0) <= 1, between.calls
                w.check(loss, inputs)
            assert swap_pass.swap_stats().swap_outs > outs_before  # the steps did swap
            assert device_knobs.order_counters() == order_before  # nothing out of order
            if way == "smartswap":
                assert w.smart.stage.value == "stable"
            if cap is not None:
                assert swap_pass.swap_stats().host_bytes_reserved <= config.max_host_bytes
        finally:
            w.close()
            swap_pass.reset()


def test_the_spy_sees_each_kind_of_wait(dev) -> None:
    """Each call that makes the host wait is counted (so a zero above means none ran)."""
    x = torch.ones(1024, device=dev)
    side = torch.Stream(device=dev)
    for wait in (lambda: x.sum().item(), lambda: x.cpu(), lambda: torch.accelerator.synchronize(),
                 lambda: side.synchronize(), lambda: torch.accelerator.empty_host_cache()):
        with count_device_syncs(dev) as spy:
            wait()
        assert spy.count >= 1, spy.calls
    start, end = torch.Event(device=dev, enable_timing=True), torch.Event(device=dev,
                                                                          enable_timing=True)
    start.record()
    x.add_(1)
    end.record()
    with count_device_syncs(dev) as spy:
        end.synchronize()
        start.elapsed_time(end)
    assert spy.calls == {"host_syncs": 1, "elapsed_time_calls": 1}
    with count_device_syncs(dev) as spy:  # queued work and a non-blocking copy to pinned memory
        host = torch.empty(1024, pin_memory=True)
        doubled = x * 2
        side.wait_stream(torch.accelerator.current_stream(dev))
        with side:
            host.copy_(doubled, non_blocking=True)
    assert spy.count == 0, spy.calls
    side.synchronize()  # before `doubled` goes back to its pool
    with pytest.raises(AssertionError, match=r"the body made the host wait for swaptest:0 1 "):
        with no_device_sync(dev, "the body"):
            x.sum().item()
