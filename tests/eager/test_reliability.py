"""Eager reliability: bad input, exceptions, autograd corners, inference, long runs, MTP."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import swap_pass
from swap_pass.tools.models import LlamaDecoderLayer
from tests.eager.helpers import (
    CFG,
    CheckpointedModel,
    SwapLlamaLayer,
    assert_clean,
    assert_exact,
    batch,
    pending_entries,
    train_step,
    twin,
)


def _pair(mode="non_reentrant", layer_cls=SwapLlamaLayer, cfg=CFG):
    torch.manual_seed(0)
    ref = CheckpointedModel(cfg, mode)
    return ref, twin(ref, lambda: CheckpointedModel(cfg, mode, layer_cls))


def _rope(s=8):
    m = CheckpointedModel(CFG, "none")
    return m.cos_table[:s], m.sin_table[:s]


# --- bad input --------------------------------------------------------------------------------


def test_missing_hidden_states_is_a_clear_error():
    layer, (cos, sin) = SwapLlamaLayer(CFG), _rope()
    with pytest.raises(ValueError, match=r"swap_pass\.swap_layer_input_forward_wrapper: .*without "
                                         r"hidden_states.*Pass the layer input"):
        layer(cos=cos, sin=sin)


def test_hidden_states_not_a_tensor_is_a_clear_error():
    layer, (cos, sin) = SwapLlamaLayer(CFG), _rope()
    with pytest.raises(TypeError,
                       match=r"hidden_states \(args\[0\]\) is a list, not a torch.Tensor"):
        layer([1.0, 2.0], cos, sin)


def test_hidden_states_on_another_device_is_a_clear_error():
    layer, (cos, sin) = SwapLlamaLayer(CFG), _rope()
    with pytest.raises(ValueError, match=r"hidden_states is on meta but .* parameters are on cpu"):
        layer(torch.empty(2, 8, CFG.hidden_size, device="meta"), cos, sin)


def test_forward_wrapper_without_init_wrapper_is_a_clear_error():
    class Half(LlamaDecoderLayer):
        @swap_pass.swap_layer_input_forward_wrapper
        def forward(self, hidden_states, cos, sin):
            return super().forward(hidden_states, cos, sin)

    (cos, sin) = _rope()
    with pytest.raises(RuntimeError, match="its __init__ was not wrapped"):
        Half(CFG)(torch.randn(2, 8, CFG.hidden_size), cos, sin)


class _TupleLayer(SwapLlamaLayer):
    """Returns ``(hidden_states, aux)`` (Megatron/MoE style), or a dict of them."""

    as_dict = False

    @swap_pass.swap_layer_input_forward_wrapper
    def forward(self, hidden_states, cos, sin):
        out = LlamaDecoderLayer.forward(self, hidden_states, cos, sin)
        aux = hidden_states.sin().mean()  # reads the layer input: a second way into its backward
        return {"hidden_states": out, "aux": aux} if self.as_dict else (out, aux)


class _TupleModel(CheckpointedModel):
    def forward(self, input_ids, labels=None, aux_only=False):
        cos, sin = self.cos_table[:input_ids.shape[1]], self.sin_table[:input_ids.shape[1]]
        h, aux = self.embed(input_ids), 0.0
        for layer in self.layers:
            out = layer(h, cos, sin)
            h, a = (out["hidden_states"], out["aux"]) if isinstance(out, dict) else out
            aux = aux + a
        if aux_only:
            return aux
        logits = self.lm_head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                           labels.reshape(-1)) + aux


class _PlainTuple(LlamaDecoderLayer):  # the same outputs, no swap
    as_dict = False

    def forward(self, hidden_states, cos, sin):
        out = super().forward(hidden_states, cos, sin)
        aux = hidden_states.sin().mean()
        return {"hidden_states": out, "aux": aux} if self.as_dict else (out, aux)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("aux_only", [False, True], ids=["all_outputs", "aux_output_only"])
def test_tuple_and_dict_outputs_swap_the_tensor_and_pass_the_rest(as_dict, aux_only, monkeypatch):
    monkeypatch.setattr(_TupleLayer, "as_dict", as_dict)
    monkeypatch.setattr(_PlainTuple, "as_dict", as_dict)
    torch.manual_seed(0)
    ref = _TupleModel(CFG, "none", _PlainTuple)
    model = twin(ref, lambda: _TupleModel(CFG, "none", _TupleLayer))
    b = batch()

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(*b, aux_only=aux_only)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                               if p.grad is not None}

    assert_exact(step(ref), step(model))
    assert swap_pass.swap_stats().swap_ins == CFG.num_layers - 1
    assert_clean()


def test_unknown_output_type_is_refused_clearly():
    class Weird(SwapLlamaLayer):
        @swap_pass.swap_layer_input_forward_wrapper
        def forward(self, hidden_states, cos, sin):
            return object()

    cos, sin = _rope()
    with pytest.raises(TypeError,
                       match=r"returned a object\. A swapped layer must return a tensor"):
        Weird(CFG)(torch.randn(2, 8, CFG.hidden_size, requires_grad=True), cos, sin)


# --- exceptions -------------------------------------------------------------------------------


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected backward fault")


class _FaultyLayer(SwapLlamaLayer):
    fail: str | None = None  # "forward" or "backward"
    target = 2

    @swap_pass.swap_layer_input_forward_wrapper
    def forward(self, hidden_states, cos, sin):
        if self.swap_manager.layer_idx == self.target and self.fail == "forward":
            raise RuntimeError("injected forward fault")
        out = LlamaDecoderLayer.forward(self, hidden_states, cos, sin)
        if self.swap_manager.layer_idx == self.target and self.fail == "backward":
            out = _Boom.apply(out)
        return out


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("mode", ["none", "non_reentrant", "reentrant"])
def test_exception_in_layer_leaves_nothing_and_next_step_is_exact(where, mode, monkeypatch):
    ref, model = _pair(mode, _FaultyLayer)
    monkeypatch.setattr(_FaultyLayer, "fail", where)
    with pytest.raises(RuntimeError, match=f"injected {where} fault"):
        loss = model(*batch())
        loss.backward()
    if where == "forward":
        assert_clean()  # at once: the wrapper put every group back
    else:
        del loss
        gc.collect()
        assert_clean()  # the failed step's graph is gone, and its groups with it
    monkeypatch.setattr(_FaultyLayer, "fail", None)
    assert_exact(train_step(ref, batch(seed=1)), train_step(model, batch(seed=1)))
    assert_clean()


# --- autograd corners -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "non_reentrant"])
def test_retain_graph_then_second_backward(mode):
    ref, model = _pair(mode)
    results = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        loss = m(*batch())
        loss.backward(retain_graph=True)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        del loss
    assert_exact(*results)
    assert swap_pass.swap_stats().swap_outs == CFG.num_layers - 1
    assert_clean()


@pytest.mark.parametrize("order", ["sum", "in_order", "reversed"])
def test_two_forwards_before_backward(order):
    ref, model = _pair("none")
    results = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        l1, l2 = m(*batch(seed=1)), m(*batch(seed=2))
        if order == "sum":
            (l1 + l2).backward()
        else:
            for loss in ((l1, l2) if order == "in_order" else (l2, l1)):
                loss.backward()
        results.append((torch.stack([l1, l2]).detach(),
                        {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert_exact(*results)
    assert swap_pass.swap_stats().swap_ins == 2 * (CFG.num_layers - 1)
    assert_clean()


def test_backward_through_part_of_the_outputs():
    """Two losses share the layers; only one is back-propagated, the other graph is dropped."""
    ref, model = _pair("none")
    results = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        loss_a, loss_b = m(*batch(seed=1)), m(*batch(seed=2))
        loss_b.backward()
        results.append((loss_b.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        if m is model:
            assert pending_entries() == CFG.num_layers - 1  # loss_a's groups wait for its graph
        del loss_a
    assert_exact(*results)
    assert_clean()


@pytest.mark.parametrize("mode", ["none", "non_reentrant", "reentrant", "megatron"])
def test_eval_and_no_grad_make_no_swaps_and_leave_nothing(mode):
    _, model = _pair(mode)
    model.eval()
    with torch.no_grad():
        model(*batch())
    with torch.inference_mode():
        model(*batch())
    assert swap_pass.swap_stats().swap_outs == 0
    assert_clean()
    loss = model(*batch())  # grad enabled, never back-propagated: swaps, then drops with the graph
    assert swap_pass.swap_stats().swap_outs == CFG.num_layers - 1
    del loss
    assert_clean()


def test_hundred_steps_each_end_with_zero_host_bytes():
    ref, model = _pair("none")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(100):
        losses = []
        for m, opt in zip((ref, model), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            loss = m(*batch(seed=step % 7, b=1, s=4))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
        assert swap_pass.swap_stats().host_bytes_in_use == 0, step
    stats = swap_pass.swap_stats()
    assert stats.swap_outs == stats.swap_ins == 100 * (CFG.num_layers - 1)
    assert stats.host_allocations <= CFG.num_layers - 1  # pooled buffers reused, not regrown
    assert_clean()


# --- MTP ----------------------------------------------------------------------------------------


class _MTPModel(CheckpointedModel):
    """Main layers, then an MTP block whose Transformer layer (``is_mtp``) runs in the same step."""

    def __init__(self, cfg, mode, layer_cls):
        super().__init__(cfg, mode, layer_cls)
        self.mtp_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mtp_layer = (layer_cls(cfg, is_mtp=True) if layer_cls is SwapLlamaLayer
                          else layer_cls(cfg))

    def forward(self, input_ids, labels=None):
        cos, sin = self.cos_table[:input_ids.shape[1]], self.sin_table[:input_ids.shape[1]]
        h = self.embed(input_ids)
        for layer in self.layers:
            h = self.run_layer(layer, h, cos, sin)
        mtp_in = self.mtp_proj(torch.cat([self.norm(h), self.embed(labels)], dim=-1))
        h2 = self.run_layer(self.mtp_layer, mtp_in, cos, sin)
        ce = nn.functional.cross_entropy
        main = ce(self.lm_head(self.norm(h)).flatten(0, 1), labels.reshape(-1))
        return main + ce(self.lm_head(self.norm(h2)).flatten(0, 1), labels.roll(-1, 1).reshape(-1))


@pytest.mark.parametrize("mode", ["none", "non_reentrant", "reentrant"])
def test_mtp_layer_runs_unchanged_without_a_manager(mode):
    class PlainMTPLayer(LlamaDecoderLayer):
        def __init__(self, cfg, is_mtp=False):
            super().__init__(cfg)

    torch.manual_seed(0)
    ref = _MTPModel(CFG, mode, PlainMTPLayer)
    model = twin(ref, lambda: _MTPModel(CFG, mode, SwapLlamaLayer))
    managers = swap_pass.SwapLayerInputManager.managers("tests.eager")
    assert len(managers) == CFG.num_layers and not hasattr(model.mtp_layer, "swap_manager")
    assert_exact(train_step(ref, batch()), train_step(model, batch()))
    assert swap_pass.swap_stats().swap_outs == CFG.num_layers - 1
    assert_clean()


# --- in-place writes and construction order ---------------------------------------------------


def test_in_place_write_to_a_swapped_input_is_caught_and_named():
    torch.manual_seed(0)
    model = CheckpointedModel(CFG, "none", SwapLlamaLayer)
    cos, sin = model.cos_table[:8], model.sin_table[:8]
    h0 = model.embed(batch()[0])
    h1 = model.layers[0](h0, cos, sin)
    with torch.no_grad():
        h0.mul_(2)  # layer 0's input, written while its copy to the host is in flight
    with pytest.raises(swap_pass.SwapDataError,
                       match=r"tests\.eager\.layers\[0\].*modified in place"):
        model.layers[1](h1, cos, sin)
    assert_clean()  # every group was put back before the error propagated


class _ScalesItsInput(nn.Module):
    """A layer that writes its input in place before reading it (allowed by autograd: nothing
    saved the input before)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return torch.sin(self.lin(x))  # SinBackward saves its input, not this output


class _InPlaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_ScalesItsInput() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h.square().sum()


@pytest.mark.unordered_on_purpose  # the layer's write races the stale copy, whose bytes go unused
def test_a_layer_writing_its_input_in_place_is_copied_from_what_it_left(device):
    """The copy out starts at the layer's entry; a layer that then writes its input in place
    makes that copy stale, so the input is copied again after the layer ran (Note: [The copy out
    starts at the layer's entry]). Exact against the same model without swap, inputs freed."""
    import weakref

    torch.manual_seed(0)
    ref = _InPlaceNet().to(device)
    model = _InPlaceNet().to(device)
    model.load_state_dict(ref.state_dict())
    handle = swap_pass.enable_swap_layer_input(model)
    assert handle.layers == list(model.layers)
    inputs, freed = [], []  # weak: a reference of ours would keep the input on the device
    for layer in model.layers[:2]:
        layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    model.layers[2].register_forward_pre_hook(lambda m, args: freed.extend(
        r().untyped_storage().nbytes() == 0 for r in inputs))
    x = torch.randn(4, 16, device=device)
    loss, ref_loss = model(x), ref(x)
    assert freed == [True, False]  # layer 0's input left the device by layer 2's entry
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    handle.remove()
    assert_clean()


def test_subclass_setting_is_mtp_after_super_init_leaves_no_orphan():
    class MTPLayer(SwapLlamaLayer):
        @swap_pass.swap_layer_input_init_wrapper
        def __init__(self, cfg):
            super().__init__(cfg)
            self.is_mtp_layer = True

    SwapLlamaLayer(CFG)
    mtp = MTPLayer(CFG)
    assert not hasattr(mtp, "swap_manager")
    assert len(swap_pass.SwapLayerInputManager.managers("tests.eager")) == 1


def test_device_check_still_fires_after_a_call_on_the_right_device():
    layer, (cos, sin) = SwapLlamaLayer(CFG), _rope()
    layer(torch.randn(2, 8, CFG.hidden_size, requires_grad=True), cos, sin)  # keeps its parameter
    with pytest.raises(ValueError, match=r"hidden_states is on meta but .* parameters are on cpu"):
        layer(torch.empty(2, 8, CFG.hidden_size, device="meta"), cos, sin)
