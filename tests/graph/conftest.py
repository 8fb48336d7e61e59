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


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` for one test (compile and run).

    Inductor's CPU code for an embedding's backward adds rows into the weight gradient with
    atomic adds from several threads, so the same compiled graph gives a gradient whose last bits
    change from run to run. With deterministic algorithms Inductor calls ATen's serial
    ``index_put_`` there instead, and a compile can be compared bitwise with another."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
