"""Graph tests partition afresh: compile caches off unless a test turns them on itself."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_compile_caches():
    """A cache hit replays the rewritten graphs without calling the partitioner, which leaves
    ``backend.partitions`` empty (the swaps still happen then), and Inductor's caches live on
    disk across runs. ``test_inductor_caches_never_hand_back_an_unswapped_graph`` turns them on
    inside this fixture to test exactly that."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


