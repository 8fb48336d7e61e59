"""A small, faithful FBOverlap-style scheduler (MindSpeed's shapes; MindSpeed is not installable).

* ``LayerGraph``: one layer's saved forward state: ``.layer``, ``.layer_input`` (detached input
  that requires grad), ``.output`` (attached output), ``.checkpointed``.
* ``transformer_layer_forward(layer, hidden_states, attention_mask, checkpoint=...)`` ->
  ``(output, context, LayerGraph)``; with ``checkpoint=True`` it runs under ``no_grad`` and the
  graph keeps only the input.
* ``transformer_layer_backward(layer_output_grad, layer_graph)`` -> input grad; recomputes a
  checkpointed layer from ``layer_graph.layer_input`` first.
* ``forward_backward_overlaping(fwd_layer, hidden_states, attention_mask, bwd_layer_output_grad,
  bwd_layer_graph, checkpoint=...)``: one layer's forward and another's backward in one call.
* ``run_schedule``: micro-batch k's forward of layer j fused with micro-batch k-1's backward of
  layer L-1-j, as MindSpeed's no-pipelining FBOverlap schedule does.

``make_functions(swap)`` returns the three functions plain, or decorated with swap_pass's
FBOverlap wrappers, so both runs share every line of scheduling code.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import swap_pass
from swap_pass.tools.models import LlamaConfig, LlamaDecoderLayer


class FBLayer(nn.Module):
    """A Transformer layer with MindSpeed's init decorator; rotary tables are its own buffers."""

    @swap_pass.swap_layer_input_init_wrapper
    def __init__(self, cfg: LlamaConfig, tag: str) -> None:
        super().__init__()
        self.swap_module_tag = tag
        self.block = LlamaDecoderLayer(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(64).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, hidden_states, attention_mask=None):
        s = hidden_states.shape[1]
        return self.block(hidden_states, self.cos[:s], self.sin[:s])


@dataclasses.dataclass
class LayerGraph:
    layer: nn.Module
    layer_input: torch.Tensor
    output: torch.Tensor | None
    checkpointed: bool


def _forward(layer, hidden_states, attention_mask, checkpoint=False):
    layer_input = hidden_states.detach().requires_grad_(True)
    with torch.no_grad() if checkpoint else contextlib.nullcontext():
        output = layer(layer_input, attention_mask)
    graph = LayerGraph(layer, layer_input, None if checkpoint else output, checkpoint)
    return output.detach(), None, graph


def _backward(layer_output_grad, layer_graph):
    if layer_graph.checkpointed:
        if layer_graph.layer_input.untyped_storage().nbytes() == 0:  # reader-side check
            raise RuntimeError("FBOverlap recompute read a layer input before its H2D finished")
        with torch.enable_grad():
            _, _, layer_graph = _forward(layer_graph.layer, layer_graph.layer_input, None)
    torch.autograd.backward(layer_graph.output, layer_output_grad)
    return layer_graph.layer_input.grad


def _forward_backward(fwd_layer, hidden_states, attention_mask, bwd_layer_output_grad,
                      bwd_layer_graph, checkpoint=False):
    output, context, graph = _forward(fwd_layer, hidden_states, attention_mask, checkpoint)
    bwd_input_grad = _backward(bwd_layer_output_grad, bwd_layer_graph)
    return output, context, graph, (bwd_input_grad, None)


def make_functions(swap: bool):
    """``(transformer_layer_forward, transformer_layer_backward, forward_backward_overlaping)``."""
    if not swap:
        return _forward, _backward, _forward_backward
    return (swap_pass.swap_layer_input_fboverlap_forward_wrapper(_forward),
            swap_pass.swap_layer_input_fboverlap_backward_wrapper(_backward),
            swap_pass.swap_layer_input_fboverlap_1f1b_wrapper(_forward_backward))


class FBModel(nn.Module):
    """Embedding, FBOverlap layers, norm and head, each layer driven by the scheduler."""

    def __init__(self, cfg: LlamaConfig, tag: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(FBLayer(cfg, tag) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class _Microbatch:
    """One micro-batch's state across the schedule."""

    def __init__(self, model: FBModel, ids, labels) -> None:
        self.model, self.labels = model, labels
        self.emb = model.embed(ids)
        self.hidden = self.emb.detach()
        self.graphs: list[LayerGraph] = []
        self.grad = None

    def finish_forward(self):
        top = self.hidden.detach().requires_grad_(True)
        logits = self.model.head(self.model.norm(top)).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), self.labels.reshape(-1))
        loss.backward()
        self.grad, self.loss = top.grad, loss.detach()

    def finish_backward(self):
        self.emb.backward(self.grad)


def run_schedule(model: FBModel, batches, swap: bool, checkpoint: bool = True, on_forward=None):
    """Train one step over ``batches`` (micro-batches); returns the losses."""
    fwd, bwd, fused = make_functions(swap)
    L = len(model.layers)
    mbs = [_Microbatch(model, *b) for b in batches]
    for _j, layer in enumerate(model.layers):  # micro-batch 0: forward only
        mbs[0].hidden, _, g = fwd(layer, mbs[0].hidden, None, checkpoint=checkpoint)
        mbs[0].graphs.append(g)
    mbs[0].finish_forward()
    if on_forward is not None:
        on_forward(mbs[0])
    # consecutive pairs: the shorter mbs[1:] ends the zip
    for prev, cur in zip(mbs, mbs[1:], strict=False):  # forward of cur fused with backward of prev
        for j, layer in enumerate(model.layers):
            bwd_graph = prev.graphs[L - 1 - j]
            cur.hidden, _, g, (prev.grad, _) = fused(layer, cur.hidden, None, prev.grad, bwd_graph,
                                                     checkpoint=checkpoint)
            cur.graphs.append(g)
        prev.finish_backward()
        cur.finish_forward()
    last = mbs[-1]
    for g in reversed(last.graphs):
        last.grad = bwd(last.grad, g)
    last.finish_backward()
    return [mb.loss for mb in mbs]
