"""Small models and graph-capturing helpers shared by the graph tests."""

from __future__ import annotations

import copy

import torch
from torch import fx

from swap_pass.tools import models
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

TINY = LlamaConfig(vocab_size=32, hidden_size=16, num_layers=3, num_heads=2,
                   intermediate_size=32, max_seq_len=64)
BATCH, SEQ = 2, 8


def tiny_model(num_layers: int = 3, *, recompute: bool = False, seed: int = 0,
               device: torch.device | str = "cpu") -> LlamaStyleModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY.__dict__, "num_layers": num_layers})
    return LlamaStyleModel(cfg, recompute=recompute).to(device)


def batch(model: LlamaStyleModel, seq: int = SEQ, seed: int = 0):
    """Token ids and labels on the model's device."""
    return make_batch(model.cfg, BATCH, seq, seed=seed, device=model.embed.weight.device)


class TraceableLlama(models.TraceableLlama):
    """The library's traceable Llama, with the inputs of a test batch."""

    def inputs(self, seq: int = SEQ, seed: int = 0):
        ids, labels = batch(self.model, seq, seed)
        return ids, self.model.cos_table[:seq], self.model.sin_table[:seq], labels


class LayerLeafTracer(fx.Tracer):
    """Keeps whole decoder layers as ``call_module`` nodes."""

    def is_leaf_module(self, m, qualname):
        return type(m).__name__ == "LlamaDecoderLayer" or super().is_leaf_module(m, qualname)


def trace(module: torch.nn.Module, *, leaf_layers: bool = False) -> fx.GraphModule:
    if not leaf_layers:
        return fx.symbolic_trace(module)
    return fx.GraphModule(module, LayerLeafTracer().trace(module))


def capture_dynamo_graph(model, *args) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def capture_aot_graphs(model, *args) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graphs of ``model`` after AOTAutograd's min-cut partitioner."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    pair = []

    def partition(joint, inputs, **kwargs):
        pair.extend(min_cut_rematerialization_partition(joint, inputs, **kwargs))
        return pair[0], pair[1]

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    torch.compile(model, backend=backend, fullgraph=True)(*args).backward()
    return pair[0], pair[1]


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def assert_grads_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None, name
        assert torch.equal(pa.grad, pb.grad), f"gradient of {name} differs"


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def hf_llama_tiny(num_layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = HFConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                   num_hidden_layers=num_layers,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


# Torch releases whose Inductor fuses a checkpointed recompute differently once prefetches sit in
# the backward (docs/graph.md, "Inductor on torch 2.14 and later"), and the written bound on the
# difference: the largest |a - b| of a gradient, over the largest |b| of that gradient.
PREFETCH_CHANGES_INDUCTOR_FUSION = (
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14))
PREFETCH_FUSION_RTOL = 1e-6


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| over the largest |b|."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def skip_inductor_on_the_test_accelerator(device: torch.device) -> None:
    """Skip an Inductor test on the test accelerator where this torch's Inductor cannot be
    registered for it (``swap_pass.testing.accelerator.inductor_reason()``); it runs there
    otherwise, with Inductor's C++ kernels in stream order."""
    import pytest

    from swap_pass.testing.accelerator import DEVICE_TYPE, inductor_reason

    if device.type == DEVICE_TYPE and inductor_reason() is not None:
        pytest.skip(f"{inductor_reason()}; the aot_eager tests run there instead")


def swap_out_sources_died():
    """Record, for every ``swap_out`` source that dies, whether its ``wait`` had run by then
    (the compute stream ordered after its copy): a list of bools that fills as sources die."""
    import swap_pass.graph.ops as ops

    deaths: list[bool] = []
    original = ops._source_died_unwaited

    def died(transfer) -> None:
        deaths.append(transfer.ordered)
        original(transfer)

    return deaths, died
