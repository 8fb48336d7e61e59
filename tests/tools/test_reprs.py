"""What users print is one short line; the long views are ``summary()`` and the attributes."""

from __future__ import annotations

import torch

import swap_pass
from swap_pass.tools.models import LlamaConfig, LlamaStyleModel, make_batch

SHORT = 300  # characters: one line in a terminal or a log


def test_smartswap_objects_print_short() -> None:
    torch.manual_seed(0)
    model = LlamaStyleModel(LlamaConfig(num_layers=2))
    ids, labels = make_batch(model.cfg, batch=2, seq=32)
    with swap_pass.SmartSwap(model, memory_budget=0.25) as smart:
        for _ in range(3):
            model(ids, labels).backward()
            smart.step()
        assert smart.stage == "stable"
        policy = smart.policy
        shown = {"smart": repr(smart), "policy": repr(policy),
                 "profile": repr(smart.last_profile), "report": repr(smart.last_report)}
    assert all(len(text) < SHORT and "\n" not in text for text in shown.values()), shown
    assert f"swapped={len(policy.swapped)}/{len(policy.candidates)} storages" in shown["policy"]
    assert f"entries={len(policy.entries)}" in shown["policy"]
    assert "stage='stable'" in shown["smart"] and shown["policy"] in shown["smart"]
    assert f"records={len(smart.last_profile.records)}" in shown["profile"]
    assert "stage='stable'" in shown["report"]
    assert all(len(repr(unit)) < SHORT for unit in smart.last_report.units)
    assert len(policy.summary()) < SHORT  # the human view stays short too
