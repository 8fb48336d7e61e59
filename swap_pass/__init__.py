"""swap_pass: move activations saved for backward to host memory and back, overlapped with compute.

Ways in (one runtime underneath):

* eager decorators / ``enable_swap_layer_input(model)``: swap each Transformer layer's input;
* ``apply_swap_pass(gm)`` and ``torch.compile(model, backend=swap_backend)``: explicit
  ``torch.ops.swap_pass.*`` nodes in traced and compiled graphs (``make_swap_backend(
  memory_budget=...)`` swaps any saved tensor); ``compile_layers(model)``: each layer compiled on
  its own (Inductor, torchair, CUDA graphs), swapped between layers eagerly;
* ``SmartSwap(model, memory_budget=...)``: profile, plan and swap under a memory budget.
"""

from __future__ import annotations

from swap_pass._version_check import check_torch_version

check_torch_version()

from swap_pass.config import OnHostExhausted, SwapConfig  # noqa: E402

# --- eager ---
from swap_pass.eager import (  # noqa: E402
    enable_swap_layer_input,
    swap_layer_input_fboverlap_1f1b_wrapper,
    swap_layer_input_fboverlap_backward_wrapper,
    swap_layer_input_fboverlap_forward_wrapper,
    swap_layer_input_forward_wrapper,
    swap_layer_input_init_wrapper,
)

# --- graph ---
from swap_pass.graph import (  # noqa: E402
    apply_swap_pass,
    compile_layers,
    find_layer_boundaries,
    make_swap_backend,
    swap_backend,
)
from swap_pass.opt_out import no_swap  # noqa: E402
from swap_pass.runtime import (  # noqa: E402
    HostMemoryError,
    SkipReason,
    SwapDataError,
    SwapLayerInputManager,
    SwapStateError,
    SwapStats,
    SwapTensors,
    is_valid_for_swap,
    reset,
    swap_stats,
)

# --- selective activation checkpointing ---
from swap_pass.sac import selective_checkpoint_contexts  # noqa: E402

# --- adaptive (SmartSwap) ---
from swap_pass.smart import SmartSwap, SmartSwapConfig  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # --- configuration ---
    "OnHostExhausted",
    "SwapConfig",
    # --- opting out ---
    "no_swap",
    # --- runtime ---
    "SkipReason",
    "SwapLayerInputManager",
    "SwapStats",
    "SwapTensors",
    "is_valid_for_swap",
    "reset",
    "swap_stats",
    # --- eager ---
    "enable_swap_layer_input",
    "swap_layer_input_fboverlap_1f1b_wrapper",
    "swap_layer_input_fboverlap_backward_wrapper",
    "swap_layer_input_fboverlap_forward_wrapper",
    "swap_layer_input_forward_wrapper",
    "swap_layer_input_init_wrapper",
    # --- graph ---
    "apply_swap_pass",
    "compile_layers",
    "find_layer_boundaries",
    "make_swap_backend",
    "swap_backend",
    # --- selective activation checkpointing ---
    "selective_checkpoint_contexts",
    # --- adaptive (SmartSwap) ---
    "SmartSwap",
    "SmartSwapConfig",
    # --- errors ---
    "HostMemoryError",
    "SwapDataError",
    "SwapStateError",
]
