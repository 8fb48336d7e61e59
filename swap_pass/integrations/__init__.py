"""Framework integrations, each imported on use so swap_pass needs none of the frameworks.

* ``swap_pass.integrations.megatron``: megatron-core (``GPTModel``, ``TransformerBlock``, model
  chunks of interleaved pipelines, MindSpeed-style layer specs).
* ``swap_pass.integrations.torchtitan``: torchtitan's model converter
  (``SwapLayerInputConverter``, listed in ``model_registry(..., converters=[...])``); a model
  built in other ways takes ``enable_swap_layer_input(model)``, which finds its ``model.layers``
  ``ModuleDict`` (see ``docs/torchtitan.md``).
"""
