"""On a torch without the offload tags, ``selective_checkpoint_contexts`` names the release."""

from __future__ import annotations

import pytest
import torch

import swap_pass
from swap_pass.sac import has_offload_policies


@pytest.mark.skipif(has_offload_policies(),
                    reason=f"torch {torch.__version__} has the offload tags; the error is for "
                           "releases without them")
def test_without_the_offload_tags_the_error_names_the_release():
    with pytest.raises(RuntimeError, match=r"has no torch.utils.checkpoint.CheckpointPolicy."
                                           r"MUST_CPU_OFFLOAD .* need torch 2.13 or later"):
        swap_pass.selective_checkpoint_contexts(lambda *a, **k: False)
