"""Print ``docs/graph.md``: a 3-layer model's graphs before and after the swap passes.

Run ``python -m swap_pass.graph.show > docs/graph.md`` (CPU, a few seconds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from swap_pass.graph.backend import make_swap_backend
from swap_pass.graph.boundaries import find_layer_boundaries
from swap_pass.graph.passes import apply_swap_pass
from swap_pass.models import LlamaConfig, LlamaStyleModel, make_batch

__all__ = ["main", "render"]

_CFG = LlamaConfig(vocab_size=32, hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32,
                   max_seq_len=16)

_INTRO = """# The graph path

`swap_pass` swaps each Transformer layer's input (the residual stream) to host memory in
traced and compiled graphs, with explicit `torch.ops.swap_pass.*` nodes:

| op | what it does |
|---|---|
| `swap_out(x)` | starts the device-to-host copy of `x` into a pooled host buffer (d2h stream); returns the host tensor |
| `wait(t, keepalive)` | makes the compute stream wait for the copy that produced `t`; `keepalive` (the source) lives until here; after an H2D it returns the host buffer to the pool |
| `prefetch(host, device, size, stride)` | allocates the device tensor on the compute stream and starts the host-to-device copy (h2d stream) |
| `swap_in(...)` | `prefetch` + `wait` in one (used with `SwapConfig(prefetch=False)`) |

All four go through `swap_pass.runtime` (streams, host pool and `max_host_bytes`, `swap_stats()`,
`reset()`), have fake kernels (Dynamo, `make_fx`, `torch.export`, AOTAutograd, Inductor) and
real CPU kernels, so the whole path runs and is tested without an accelerator.

Ways in:

```python
import swap_pass
print(swap_pass.find_layer_boundaries(gm))                     # what the passes act on
gm = swap_pass.apply_swap_pass(torch.fx.symbolic_trace(model))  # eager autograd on a traced graph
compiled = torch.compile(model, backend=swap_pass.swap_backend)  # torch.compile (Inductor)
backend = swap_pass.make_swap_backend("aot_eager", layer_filter=r"model\\.layers\\.\\d+",
                                      config=swap_pass.SwapConfig(prefetch=True))
```

* `find_layer_boundaries` finds the largest family of same-class modules named
  `<parent>.<index>` from `call_module` targets or `meta["nn_module_stack"]`
  (`fwd_nn_module_stack` in backward graphs); `layer_filter` (regex on the module name with
  `re.fullmatch`, classes, or a callable) overrides the guess.
* `apply_swap_pass` (eager autograd) frees a layer's input in place when the next layer starts and
  restores it in the backward of an autograd Function on the next layer's input, which runs before
  any backward node of the layer (checkpoint recompute included). Gradients are bitwise equal.
* `swap_backend` rewrites the partitioned forward/backward pair (Inductor's own pipeline through
  its custom-partitioner hook; min-cut for the others): the saved layer input is swapped out as
  soon as it exists, its `wait` sits where the next layer starts, the host copy is what is saved;
  the backward prefetches it before the first backward node of the layer after it and waits right
  before its first reader. Gradients: bitwise equal to `aot_eager` without swap; within
  rtol=1e-5/atol=1e-6 of Inductor without swap (observed bitwise on CPU; swap nodes are fusion
  barriers, so kernels around them may be ordered differently).

Known limits: `wait` returns an alias, so it cannot itself be traced through functionalization
(it is inserted after partitioning, as PyTorch's `ao.wait_tensor` is); `inner="npu"` hands the
graphs to torchair's compiler, which needs converters for the `swap_pass` ops (untested here);
`SwapConfig(on_host_exhausted="keep_on_device")` is not honoured by the compiled path (a full
host pool raises `HostMemoryError`).

The graphs below are printed by `python -m swap_pass.graph.show` for a 3-layer model with
activation checkpointing (`LlamaStyleModel(recompute=True)`), so each layer saves only its input.
"""


_BOXED = ("args_iter = iter(args_list)", "= next(args_iter)", "args_list.clear()")


def _code(gm: fx.GraphModule) -> str:
    """The graph's Python code without blank lines and boxed-call unpacking."""
    lines = [line for line in gm.code.strip().splitlines()
             if line.strip() and not any(b in line for b in _BOXED)]
    return "\n".join(lines)


def _capture(backend_inner):
    """Forward/backward graphs after partitioning, with and without swap."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    pairs = {}

    def plain(joint, inputs, **kwargs):
        pairs["before"] = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        return pairs["before"]

    for name, backend in (("before", aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                  partition_fn=plain)),
                          ("after", backend_inner)):
        torch.manual_seed(0)
        model = LlamaStyleModel(_CFG, recompute=True)
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
    """The whole of ``docs/graph.md``."""
    backend = make_swap_backend("aot_eager")
    (fw0, bw0), (fw1, bw1), swapped = _capture(backend)
    out = [_INTRO, *_eager_pass_section(), "## `swap_backend`: what it swapped", "", "```",
           *map(str, swapped), "```", ""]
    for title, gm in (("Forward graph before the pass", fw0), ("Forward graph after the pass", fw1),
                      ("Backward graph before the pass", bw0), ("Backward graph after the pass", bw1)):
        out += [f"### {title}", "", "```python", _code(gm), "```", ""]
    return "\n".join(out)


def main() -> None:
    print(render())


if __name__ == "__main__":
    main()
