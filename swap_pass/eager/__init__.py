"""Eager SwapLayerInput: MindSpeed's decorators and no-edit ``enable_swap_layer_input``."""

from __future__ import annotations

from swap_pass.eager.enable import SwapLayerInputHandle, enable_swap_layer_input, find_layer_blocks
from swap_pass.eager.wrappers import (
    swap_layer_input_fboverlap_1f1b_wrapper,
    swap_layer_input_fboverlap_backward_wrapper,
    swap_layer_input_fboverlap_forward_wrapper,
    swap_layer_input_forward_wrapper,
    swap_layer_input_init_wrapper,
)

__all__ = [
    "SwapLayerInputHandle",
    "enable_swap_layer_input",
    "find_layer_blocks",
    "swap_layer_input_fboverlap_1f1b_wrapper",
    "swap_layer_input_fboverlap_backward_wrapper",
    "swap_layer_input_fboverlap_forward_wrapper",
    "swap_layer_input_forward_wrapper",
    "swap_layer_input_init_wrapper",
]
