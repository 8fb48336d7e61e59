"""Per-block compile on FSDP2 (also with ``checkpoint_wrapper`` on every block) and tensor +
sequence parallel, 2 gloo ranks (CPU).

Each block compiled with ``swap_pass.compile_layers(model, backend="aot_eager")`` (torchtitan
compiles per block; the swap between blocks runs eagerly), against the same per-block compile
without swap: three optimizer steps exact, every block's input but the last off the device at the
end of forward, bytes released per rank, nothing pending; the checks of
``test_data_tensor_parallel``. Dynamo compiled the blocks without a graph break. One spawned
process pair for every setup.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import dist_worker
from tests.distributed.spawn import spawn_ranks
from tests.distributed.test_data_tensor_parallel import check

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return spawn_ranks(dist_worker.run, 2, tmp_path_factory.mktemp("compile"),
                       dist_worker.COMPILE_SETUPS, seconds=840)


@pytest.mark.parametrize("setup", dist_worker.COMPILE_SETUPS)
def test_compile_layers_exact_and_swapped_on_every_rank(reports, setup):
    check(reports, setup)
    for rank, report in enumerate(reports):
        compiled = report[setup]["compiled"]
        assert compiled["graphs"] >= 1 and compiled["breaks"] == 0, (rank, compiled)
