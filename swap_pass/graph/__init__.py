"""The graph path: ``torch.ops.swap_pass.*`` ops, layer boundaries, the fx pass, the compile backend."""

from __future__ import annotations

from swap_pass.graph import ops  # noqa: F401  (registers torch.ops.swap_pass.*)
