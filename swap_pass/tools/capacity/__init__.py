"""How much bigger can a model train: capacity under a device-memory cap, measured and planned.

* :mod:`~swap_pass.tools.capacity.search`: the largest size that fits (exponential, then binary).
* :mod:`~swap_pass.tools.capacity.planned`: that search over the memory model
  (``swap-pass plan --device-memory``).
* :mod:`~swap_pass.tools.capacity.measured`: that search over measured steps
  (``swap-pass capacity``).
* :mod:`~swap_pass.tools.capacity.limits`: the device-memory cap (real or virtual), host memory,
  sizes in bytes.
* :mod:`~swap_pass.tools.capacity.report`: their tables and the JSON file.

The predicted bytes of a training step per method (the memory model, which ``swap-pass plan``
shares) are in :mod:`swap_pass.tools.memory_model`. See ``docs/capacity.md``.
"""
