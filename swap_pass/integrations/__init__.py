"""Framework integrations, each imported on use so swap_pass needs none of the frameworks.

* ``swap_pass.integrations.megatron``: megatron-core (``GPTModel``, ``TransformerBlock``, model
  chunks of interleaved pipelines, MindSpeed-style layer specs).
* torchtitan needs no module of its own: ``enable_swap_layer_input(model)`` finds its
  ``model.layers`` ``ModuleDict`` (see ``docs/torchtitan.md``).
"""
