"""TRL's and torchtune's activation-offloading flags served by swap_pass
(``swap_pass.integrations.offload_flags``), on a real tiny HF Qwen2.

With the layers checkpointed, the context swaps each layer input and no other saved-tensor hook
runs: exact against HF checkpointing without offload. Without checkpointing, or without a layer
family, the step goes to the tool's own manager (here torch's ``save_on_cpu``, which runs on any
device, in the tool's place), said once and counted. TRL and torchtune themselves run in
``tests/integrations`` (their own venv).
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass.integrations import torchtune as swap_torchtune
from swap_pass.integrations import trl as swap_trl
from swap_pass.integrations.offload_flags import LayerInputOffload
from swap_pass.tools.bench.hf_offload import hf_checkpointing_enable
from tests.eager.helpers import assert_clean
from tests.peers.helpers import assert_same_step, grads, qwen_batch, tiny_qwen2, twins

pytest.importorskip("transformers")

L = 3
LAYER_INPUT = 2 * 8 * 32 * 4  # batch 2, sequence 8, hidden 32, fp32


def _checkpointed(device, checkpointing: bool = True):
    def build():
        model = tiny_qwen2(layers=L).to(device)
        model.config.use_cache = False
        if checkpointing:
            hf_checkpointing_enable(model)
        return model.train()

    return twins(build)


def _hooks_in_layers(model) -> list:
    """Record the saved-tensor hooks each decoder layer is called under (before its own
    checkpoint installs one)."""
    seen = []
    top = torch._C._autograd._top_saved_tensors_default_hooks
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(top(False)))
    return seen


def _step(model, ids, context, *, around_backward: bool):
    """One step with ``context`` around the forward (torchtune) or forward and backward (TRL)."""
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(input_ids=ids, labels=ids).loss
        if around_backward:
            loss.backward()
    if not around_backward:
        loss.backward()
    return loss.detach(), grads(model)


def _ids(i: int, device):
    return qwen_batch(i)[0].to(device)


@pytest.mark.parametrize("tool", ["trl", "torchtune"])
def test_checkpointed_layers_swap_their_inputs_and_nothing_else(tool, device):
    ref, model = _checkpointed(device)
    if tool == "trl":
        served = swap_trl.get_act_offloading_ctx_manager(model)
    else:
        served = swap_torchtune.get_act_offloading_ctx_manager(model, True)
    assert served.handle is None  # decided at the first ``with``
    seen = _hooks_in_layers(model)
    for i in range(3):
        ids = _ids(i, device)
        kept = ids.clone()
        expected = _step(ref, ids, contextlib.nullcontext(), around_backward=True)
        assert_same_step(expected, _step(model, ids, served, around_backward=tool == "trl"))
        assert torch.equal(ids, kept)
    assert seen == [None] * (3 * L)  # no tool hook (nor save_on_cpu) around any layer
    assert served.handed_back is None and served.handle.layers == list(model.model.layers)
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 3 * (L - 1) * LAYER_INPUT
    assert "handed_back" not in stats.skips
    assert_clean()
    handle = served.handle
    served.remove()
    assert not handle.active and "swap_manager" not in vars(model.model.layers[0])
    with served:  # decided again: swapping again
        assert served.handle is not None and served.handle.active
    served.remove()


def test_trl_knobs_map_to_the_swap_config():
    _, model = _checkpointed("cpu")
    served = swap_trl.get_act_offloading_ctx_manager(
        model, use_pin_memory=False, use_streams=False, min_offload_size=LAYER_INPUT + 1)
    with served:
        model(input_ids=_ids(0, "cpu"), labels=_ids(0, "cpu")).loss.backward()
    config = served.handle.managers[0].config
    assert (config.pin_memory, config.use_streams, config.min_swap_bytes) == (
        False, False, LAYER_INPUT + 1)
    assert swap_pass.swap_stats().skipped_bytes["too_small"] == (L - 1) * LAYER_INPUT
    served.remove()


def _handed_back_to_save_on_cpu(model):
    return LayerInputOffload(model, tool="TRL",
                             checkpointing_hint="set gradient_checkpointing=True",
                             theirs=lambda: torch.autograd.graph.save_on_cpu(pin_memory=False))


def test_without_checkpointing_the_tool_keeps_its_offload_said_once_and_counted(device):
    ref, model = _checkpointed(device, checkpointing=False)
    served = _handed_back_to_save_on_cpu(model)
    seen = _hooks_in_layers(model)
    with pytest.warns(RuntimeWarning, match=r"TRL's activation offloading of this "
                      r"Qwen2ForCausalLM stays TRL's own .*3 of its 3 layers \(Qwen2DecoderLayer\)"
                      r" are not activation-checkpointed.*set gradient_checkpointing=True, or use "
                      r"swap_pass.SmartSwap"):
        for i in range(3):
            ids = _ids(i, device)
            expected = _step(ref, ids, contextlib.nullcontext(), around_backward=True)
            assert_same_step(expected, _step(model, ids, served, around_backward=True))
    assert served.handle is None and served.handed_back is not None
    assert all(hooks is not None and "pack_to_cpu" in hooks[0].__qualname__ for hooks in seen)
    assert len(seen) == 3 * L
    stats = swap_pass.swap_stats()
    assert stats.skips["handed_back"] == 3 and stats.skipped_bytes["handed_back"] == 0
    assert stats.swapped_out_bytes == 0


def test_a_model_without_a_layer_family_is_handed_back_naming_layers():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    served = _handed_back_to_save_on_cpu(model)
    with pytest.warns(RuntimeWarning, match=r"found no layer family .* in Sequential.*pass "
                      r"layers=\[\.\.\.\] to swap_pass's TRL integration"):
        with served:
            model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert swap_pass.swap_stats().skips["handed_back"] == 1


def test_a_handle_the_user_enabled_serves_the_flag_and_stays():
    _, model = _checkpointed("cpu")
    handle = swap_pass.enable_swap_layer_input(model)
    served = swap_trl.get_act_offloading_ctx_manager(model)
    with served:
        model(input_ids=_ids(0, "cpu"), labels=_ids(0, "cpu")).loss.backward()
    assert served.handle is handle
    served.remove()
    assert handle.active and served.handle is None
    handle.remove()


def test_handed_back_without_the_tool_installed_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.setitem(sys.modules, "trl.models", None)
    _, model = _checkpointed("cpu", checkpointing=False)
    served = swap_trl.get_act_offloading_ctx_manager(model)
    with (pytest.warns(RuntimeWarning, match="not activation-checkpointed"),
          pytest.raises(ImportError, match=r"goes to TRL's own activation offloading \(the "
                        r"warning before says why\), and TRL does not import here .* Install "
                        "trl, or change what the warning names")):
        served.__enter__()
    with pytest.raises(ImportError):
        swap_trl.serve_activation_offloading()


def test_torchtune_flag_off_is_a_context_that_does_nothing():
    _, model = _checkpointed("cpu")
    assert isinstance(swap_torchtune.get_act_offloading_ctx_manager(model, False),
                      contextlib.nullcontext)
    assert "swap_manager" not in vars(model.model.layers[0])


def test_layers_swap_cannot_enable_on_are_handed_back_with_the_reason():
    """A block compiled with ``nn.Module.compile`` is refused by ``enable_swap_layer_input``; the
    flag then stays the tool's own, with enable's reason in the warning."""
    _, model = _checkpointed("cpu")
    model.model.layers[0].compile(backend="eager")
    served = _handed_back_to_save_on_cpu(model)
    with pytest.warns(RuntimeWarning, match=r"stays TRL's own .*swap_pass cannot swap its layers "
                      r"\(swap_pass.enable_swap_layer_input: layers\[0\] .* was compiled"):
        with served:
            pass
    assert served.handle is None and "swap_manager" not in vars(model.model.layers[1])
    assert swap_pass.swap_stats().skips["handed_back"] == 1
