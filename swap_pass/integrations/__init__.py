"""Framework integrations, each imported on use so swap_pass needs none of the frameworks.

* ``swap_pass.integrations.megatron``: megatron-core (``GPTModel``, ``TransformerBlock``, model
  chunks of interleaved pipelines, MindSpeed-style layer specs).
* ``swap_pass.integrations.trl`` and ``swap_pass.integrations.torchtune``: their
  activation-offloading flags served by the layer-input swap (``offload_flags.py``:
  ``LayerInputOffload``); neither imports its tool until a step is handed back to it.
* ``swap_pass.integrations.torchtitan``: torchtitan's model converter
  (``SwapLayerInputConverter``, listed in ``model_registry(..., converters=[...])``); a model
  built in other ways takes ``enable_swap_layer_input(model)``, which finds its ``model.layers``
  ``ModuleDict`` (see ``docs/torchtitan.md``).
"""
