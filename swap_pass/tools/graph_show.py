"""Print a 3-layer model's graphs before and after the swap passes (the dumps docs/graph.md cites).

Run ``python -m swap_pass.tools.graph_show`` (CPU, a few seconds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from swap_pass import apply_swap_pass, find_layer_boundaries, make_swap_backend
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

__all__ = ["main", "render"]

_CFG = LlamaConfig(vocab_size=32, hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32,
                   max_seq_len=16)

_INTRO = """# swap_pass graph dumps

Printed by `python -m swap_pass.tools.graph_show` (what the passes do is in docs/graph.md): a
3-layer `LlamaStyleModel(recompute=True)` (hidden 16, batch 2, seq 8), so each layer saves only its
input; the compile graphs come from `make_swap_backend("aot_eager")` (layer-input mode) and, at the
end, what `make_swap_backend("aot_eager", memory_budget=0.5)` chooses for the same model without
checkpointing.
"""


_BOXED = ("args_iter = iter(args_list)", "= next(args_iter)", "args_list.clear()")


def _code(gm: fx.GraphModule) -> str:
    """The graph's Python code without blank lines and boxed-call unpacking."""
    lines = [line for line in gm.code.strip().splitlines()
             if line.strip() and not any(b in line for b in _BOXED)]
    return "\n".join(lines)


def _capture(backend_inner, recompute: bool = True):
    """Forward/backward graphs after partitioning, with and without swap."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    pairs = {}

    def plain(joint, inputs, **kwargs):
        pairs["before"] = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        return pairs["before"]

    for _name, backend in (("before", aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                  partition_fn=plain)),
                          ("after", backend_inner)):
        torch.manual_seed(0)
        model = LlamaStyleModel(_CFG, recompute=recompute)
        torch._dynamo.reset()
        torch.compile(model, backend=backend, fullgraph=True)(*make_batch(_CFG, 2, 8)).backward()
    part = backend_inner.partitions[-1]
    return pairs["before"], (part.forward, part.backward), part.swapped


class _Traceable(torch.nn.Module):
    def __init__(self, model: LlamaStyleModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, cos, sin, labels):
        h = self.model.embed(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        logits = self.model.lm_head(self.model.norm(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def _eager_pass_section() -> list[str]:
    torch.manual_seed(0)
    traceable = _Traceable(LlamaStyleModel(_CFG))
    gm = fx.symbolic_trace(traceable)
    bounds = find_layer_boundaries(gm)
    apply_swap_pass(gm)
    added = [line for line in _code(gm).splitlines() if line.strip().startswith("swap_pass_")]
    return ["## `apply_swap_pass` on a `symbolic_trace` graph", "",
            "`find_layer_boundaries(gm)`:", "", "```", *map(str, bounds), "```", "",
            "Nodes the pass added (the rest of the graph is unchanged):", "", "```python", *added,
            "```", ""]


def render() -> str:
    """The dumps: layer boundaries, graphs before and after each pass, budget mode's choice."""
    backend = make_swap_backend("aot_eager")
    (fw0, bw0), (fw1, bw1), swapped = _capture(backend)
    out = [_INTRO, *_eager_pass_section(), "## `swap_backend`: what it swapped", "", "```",
           *map(str, swapped), "```", ""]
    for title, gm in (("Forward graph before the pass", fw0),
                      ("Forward graph after the pass", fw1),
                      ("Backward graph before the pass", bw0),
                      ("Backward graph after the pass", bw1)):
        out += [f"### {title}", "", "```python", _code(gm), "```", ""]
    return "\n".join(out + _budget_section())


def _budget_section() -> list[str]:
    from swap_pass.graph.budget import CostModel

    backend = make_swap_backend("aot_eager", memory_budget=0.5,
                                cost_model=CostModel(copy_bytes_per_s=25e9, flops_per_s=1e12))
    _, (fw, bw), _ = _capture(backend, recompute=False)
    return ["## Budget mode (no checkpointing, `memory_budget=0.5`)", "", "```",
            backend.partitions[-1].summary(), "```", "", "### Forward graph after the pass", "",
            "```python", _code(fw), "```", "", "### Backward graph after the pass", "", "```python",
            _code(bw), "```", ""]


def main() -> None:
    print(render())


if __name__ == "__main__":
    main()
