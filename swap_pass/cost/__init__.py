"""What a swap costs: bytes and seconds from a model's shape (:mod:`.model`), and the copy and
matmul rates measured on this process's devices (:mod:`.probes`). Budget mode and SmartSwap both
read it; neither imports the other.
"""
