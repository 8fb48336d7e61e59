"""TRL's ``SFTTrainer`` with ``activation_offloading=True`` served by swap_pass, end to end.

A tiny Qwen2 and a word-level tokenizer built locally, a pre-tokenized dataset, a few steps on
CPU. With ``gradient_checkpointing=True`` and ``serve_activation_offloading()`` the trainer's
offloading context swaps each checkpointed layer's input: the logged losses and the final
parameters equal (``torch.equal``) those of the same trainer with the flag off. Without
checkpointing the step goes to TRL's own offloading, said once (and on a machine without an
accelerator TRL's own manager fails as it does without swap_pass); on the test accelerator, where
TRL's manager runs, that hand-back is exact and the device sees nothing out of order.

Needs TRL and datasets (CI installs them in the frameworks venv of ``.ci/run``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
        assert served_modules.modules == ["trl.trainer.sft_trainer", "trl.trainer.dpo_trainer",
                                          "trl.trainer.kto_trainer", "trl.trainer.reward_trainer"]
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


# Run in a fresh interpreter: loading the test accelerator makes it torch's accelerator for the
# rest of the process, which the other tests of this venv do not expect.
_HANDED_BACK_ON_THE_DEVICE = """
import contextlib, json, warnings
import torch
import swap_pass
from swap_pass.integrations import trl as swap_trl
from swap_pass.testing import accelerator as device_knobs, load_test_accelerator
from tests.peers.helpers import grads, qwen_batch, tiny_qwen2

dev = torch.device(load_test_accelerator(), 0)

def build():
    model = tiny_qwen2(layers=3).to(dev)
    model.config.use_cache = False
    return model.train()

ref, model = build(), build()
served = swap_trl.get_act_offloading_ctx_manager(model)
before = device_knobs.order_counters()
exact = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(3):
        ids = qwen_batch(i)[0].to(dev)
        steps = []
        for m, context in ((ref, contextlib.nullcontext()), (model, served)):
            m.zero_grad(set_to_none=True)
            with context:
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            steps.append((loss.detach().cpu(), {n: g.cpu() for n, g in grads(m).items()}))
        (ref_loss, ref_grads), (loss, got) = steps
        exact.append(torch.equal(ref_loss, loss) and ref_grads.keys() == got.keys()
                     and all(torch.equal(ref_grads[n], got[n]) for n in ref_grads))
device_knobs.synchronize()
print(json.dumps({
    "exact": exact, "theirs": type(served.handed_back).__name__,
    "handed_back": swap_pass.swap_stats().skips.get("handed_back"),
    "swapped": swap_pass.swap_stats().swapped_out_bytes,
    "unordered": {k: v - before[k] for k, v in device_knobs.order_counters().items()},
    "warnings": [str(w.message) for w in caught if "stays TRL's own" in str(w.message)]}))
"""


def test_without_checkpointing_trl_own_offload_runs_and_is_exact_on_the_test_accelerator():
    """On the test accelerator TRL's ``OffloadActivations`` runs (its streams on the device's):
    a model without checkpointing is handed back to it, warned once and counted; its steps equal
    the same model without offload bitwise, and the device saw nothing out of order."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _HANDED_BACK_ON_THE_DEVICE], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["theirs"] == "OffloadActivations" and out["handed_back"] == 3
    assert out["exact"] == [True, True, True] and out["swapped"] == 0
    assert len(out["warnings"]) == 1 and "not activation-checkpointed" in out["warnings"][0]
    assert set(out["unordered"].values()) == {0}, out
