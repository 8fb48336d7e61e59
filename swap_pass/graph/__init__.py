"""The graph path: ``torch.ops.swap_pass.*`` ops, layer boundaries, the fx pass, the compile
backend.

* :func:`find_layer_boundaries` -- which layers a graph holds and the tensor entering each;
* :func:`apply_swap_pass` -- swap layer inputs in a traced graph trained in eager autograd;
* :data:`swap_backend` / :func:`make_swap_backend` -- the same under ``torch.compile``, or any
  saved tensor under a memory budget;
* :func:`compile_layers` -- regional compile: each layer compiled alone, swapped between layers.
"""

from __future__ import annotations

from swap_pass.graph import ops  # noqa: F401  (registers torch.ops.swap_pass.*)
from swap_pass.graph.backend import make_swap_backend, swap_backend
from swap_pass.graph.boundaries import LayerBoundary, find_layer_boundaries
from swap_pass.graph.passes import apply_swap_pass
from swap_pass.graph.regional import compile_layers

__all__ = ["LayerBoundary", "apply_swap_pass", "compile_layers", "find_layer_boundaries",
           "make_swap_backend", "swap_backend"]
