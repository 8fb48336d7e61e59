"""TRL's ``SFTTrainer`` with ``activation_offloading=True`` served by swap_pass, end to end.

A tiny Qwen2 and a word-level tokenizer built locally, a pre-tokenized dataset, a few steps on
CPU. With ``gradient_checkpointing=True`` and ``serve_activation_offloading()`` the trainer's
offloading context swaps each checkpointed layer's input: the logged losses and the final
parameters equal (``torch.equal``) those of the same trainer with the flag off. Without
checkpointing the step goes to TRL's own offloading, said once (and on a machine without an
accelerator TRL's own manager fails as it does without swap_pass).

Needs TRL and datasets (CI installs them in the frameworks venv of ``.ci/run``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install trl datasets)")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer import sft_trainer  # noqa: E402

import swap_pass  # noqa: E402
from swap_pass.integrations import trl as swap_trl  # noqa: E402
from tests.peers.helpers import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")
L, STEPS = 3, 3
LAYER_INPUT = 2 * 8 * 32 * 4  # batch 2, sequence 8, hidden 32, fp32


def _tokenizer():
    vocab = {f"t{i}": i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t1", eos_token="t2",
                                   unk_token="t0")


def _data():
    g = torch.Generator().manual_seed(3)
    return Dataset.from_dict(
        {"input_ids": [torch.randint(3, 64, (8,), generator=g).tolist() for _ in range(8)]})


def _trainer(tmp_path, *, offloading: bool, checkpointing: bool = True) -> SFTTrainer:
    model = tiny_qwen2(layers=L)
    model.config.use_cache = False
    args = SFTConfig(output_dir=str(tmp_path / f"run{int(offloading)}{int(checkpointing)}"),
                     max_steps=STEPS, per_device_train_batch_size=2,
                     gradient_checkpointing=checkpointing, activation_offloading=offloading,
                     learning_rate=0.1, report_to=[], save_strategy="no", logging_steps=1,
                     use_cpu=True, dataloader_num_workers=0, seed=0, bf16=False)
    return SFTTrainer(model=model, args=args, train_dataset=_data(), processing_class=_tokenizer())


def _train(trainer: SFTTrainer):
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_sft_trainer_flag_served_exactly_as_the_flag_off(tmp_path):
    theirs = sft_trainer.get_act_offloading_ctx_manager
    expected_losses, expected = _train(_trainer(tmp_path, offloading=False))
    assert swap_pass.swap_stats().swapped_out_bytes == 0
    with swap_trl.serve_activation_offloading() as served_modules:
        assert "trl.trainer.sft_trainer" in served_modules.modules
        trainer = _trainer(tmp_path, offloading=True)
    assert sft_trainer.get_act_offloading_ctx_manager is theirs  # given back on leaving
    served = trainer.maybe_activation_offload_context
    losses, got = _train(trainer)
    assert len(losses) == STEPS and losses == expected_losses
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert served.handed_back is None and served.handle.layers == list(trainer.model.model.layers)
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == STEPS * (L - 1) * LAYER_INPUT
    assert stats.host_bytes_in_use == 0 and "handed_back" not in stats.skips
    served.remove()


def test_sft_trainer_without_checkpointing_keeps_trl_offload_and_says_so(tmp_path):
    with swap_trl.serve_activation_offloading():
        trainer = _trainer(tmp_path, offloading=True, checkpointing=False)
    warning = pytest.warns(RuntimeWarning, match=r"TRL's activation offloading of this "
                           r"Qwen2ForCausalLM stays TRL's own .*set gradient_checkpointing=True "
                           r"in the trainer's config")
    if torch.accelerator.current_accelerator() is None:
        # TRL's OffloadActivations asks torch.accelerator for its device: it fails here, with or
        # without swap_pass (without, when the trainer is built).
        with warning, pytest.raises(AttributeError, match="'NoneType' object has no attribute"):
            trainer.train()
        return
    with warning:
        trainer.train()
    assert swap_pass.swap_stats().skips["handed_back"] == STEPS
    assert swap_pass.swap_stats().swapped_out_bytes == 0
