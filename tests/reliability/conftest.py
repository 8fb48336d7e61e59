"""One intra-op thread for the reliability tests: on the 2-core CI, torch's default pool plus
pytest (and the two training threads of test_threads) oversubscribe the cores and a step of the
tiny model takes ten times longer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
