"""torchtune's ``enable_activation_offloading: True`` served by swap_pass on torchtune's own model.

A tiny ``torchtune.models.llama3.llama3`` with torchtune's ``training.set_activation_checkpointing``
(every ``TransformerSelfAttentionLayer`` in a ``CheckpointWrapper``), trained the way torchtune's
recipes train: the offloading context around the forward, the loss and the backward outside it.
``swap_pass.integrations.torchtune.get_act_offloading_ctx_manager`` in place of torchtune's gives
the losses and gradients (``torch.equal``) of torchtune's with the flag off, with each layer input
but the last swapped. torchtune's own offloading needs CUDA; where there is none it is not run.

Needs torchtune (CI installs it, with torchao, in the frameworks venv of ``.ci/run``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtune", reason="torchtune is not installed (pip install torchtune "
                    "torchao)")

from torchtune import modules, training  # noqa: E402
from torchtune.models.llama3 import llama3  # noqa: E402

import swap_pass  # noqa: E402
from swap_pass.integrations import torchtune as swap_torchtune  # noqa: E402
from tests.peers.helpers import assert_same_step, grads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")
L, VOCAB, DIM = 3, 64, 32
LAYER_INPUT = 2 * 8 * DIM * 4


def _model(checkpointing: bool = True):
    torch.manual_seed(0)
    model = llama3(vocab_size=VOCAB, num_layers=L, num_heads=4, num_kv_heads=2, embed_dim=DIM,
                   max_seq_len=64)
    if checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    return model


def _step(model, ids, context):
    """torchtune's ``_loss_step``: the context around the forward only."""
    model.zero_grad(set_to_none=True)
    with context:
        logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
    loss.backward()
    return loss.detach(), grads(model)


def test_recipe_context_served_exactly_as_the_flag_off():
    ref, model = _model(), _model()
    plain = training.get_act_offloading_ctx_manager(ref, False)
    served = swap_torchtune.get_act_offloading_ctx_manager(model, True)
    for i in range(3):
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(i))
        kept = ids.clone()
        assert_same_step(_step(ref, ids, plain), _step(model, ids, served))
        assert torch.equal(ids, kept)
    assert type(model.layers[0]).__name__ == "CheckpointWrapper"
    assert served.handed_back is None and served.handle.layers == list(model.layers)
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 3 * (L - 1) * LAYER_INPUT
    assert stats.host_bytes_in_use == 0
    served.remove()


def test_layers_not_checkpointed_go_to_torchtune_offload_and_say_so():
    served = swap_torchtune.get_act_offloading_ctx_manager(_model(checkpointing=False), True)
    warning = pytest.warns(RuntimeWarning, match=r"torchtune's activation offloading of this "
                           r"TransformerDecoder stays torchtune's own .*3 of its 3 layers "
                           r"\(TransformerSelfAttentionLayer\) are not activation-checkpointed.*"
                           r"set enable_activation_checkpointing: True")
    if not torch.cuda.is_available():  # torchtune's OffloadActivations is CUDA-only
        with warning, pytest.raises(AssertionError, match="Torch not compiled with CUDA"):
            with served:
                pass
        return
    with warning, served:
        pass
    assert swap_pass.swap_stats().skips["handed_back"] == 1
