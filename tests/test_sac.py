"""``swap_pass.selective_checkpoint_contexts``: offload tags of selective checkpointing, eager.

Every step is compared with the same model without checkpointing (``torch.equal`` on the loss
and every gradient); the bytes moved come from ``swap_stats()``, and the tagged outputs' storages
are looked at after the forward.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import swap_pass
from swap_pass.sac import has_offload_policies

pytestmark = pytest.mark.skipif(
    not has_offload_policies(),
    reason=f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD / "
           "PREFER_CPU_OFFLOAD (torch 2.13 and later have them)")

N, HIDDEN, INNER, BLOCKS = 16, 32, 64, 3
ADDMM = torch.ops.aten.addmm.default


def _policy(tag_name: str, ops=(ADDMM,)):
    from torch.utils.checkpoint import CheckpointPolicy

    def policy_fn(ctx, op, *args, **kwargs):
        if op in ops:
            return getattr(CheckpointPolicy, tag_name)
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, INNER)
        self.down = nn.Linear(INNER, HIDDEN)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Blocks, each checkpointed with ``context_fn`` (or run plainly when it is None)."""

    def __init__(self, context_fn=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.context_fn = context_fn

    def forward(self, x):
        for block in self.blocks:
            if self.context_fn is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=False, context_fn=self.context_fn)
        return x.square().mean()


def _step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_exact(ref, got):
    assert torch.equal(ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    for name in ref[1]:
        assert torch.equal(ref[1][name], got[1][name]), name


def _input():
    return torch.randn(N, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _contexts(policy_fn, made: list | None = None, **kwargs):
    def context_fn():
        pair = swap_pass.selective_checkpoint_contexts(policy_fn, **kwargs)
        if made is not None:
            made.append(pair)
        return pair

    return context_fn


OFFLOADED_BYTES = BLOCKS * N * (INNER + HIDDEN) * 4


@pytest.mark.parametrize("tag", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_offload_tags_swap_the_outputs_exactly(tag):
    x = _input()
    x_before = x.detach().clone()
    ref = _step(Stack(), x)
    made = []
    model = Stack(_contexts(_policy(tag), made))
    model.zero_grad(set_to_none=True)
    loss = model(x)
    swapped = [e.group.tensors[0] for fwd, _ in made for e in fwd.region.entries]
    assert [tuple(t.shape) for t in swapped] == [(N, INNER), (N, HIDDEN)] * BLOCKS
    assert all(t.untyped_storage().nbytes() == 0 for t in swapped)  # freed on the device
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == OFFLOADED_BYTES and stats.swap_outs == 2 * BLOCKS
    assert stats.device_bytes_released == OFFLOADED_BYTES
    loss.backward()
    got = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    _assert_exact(ref, got)
    stats = swap_pass.swap_stats()
    assert stats.swapped_in_bytes == OFFLOADED_BYTES and stats.host_bytes_in_use == 0
    assert torch.equal(x.detach(), x_before)  # the user's input is untouched


def test_other_tags_behave_as_torch():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    x = _input()
    policy = _policy("MUST_SAVE")
    ref = _step(Stack(functools.partial(create_selective_checkpoint_contexts, policy)), x)
    _assert_exact(ref, _step(Stack(_contexts(policy)), x))
    _assert_exact(ref, _step(Stack(_contexts([ADDMM])), x))  # torch's list form
    assert swap_pass.swap_stats().swapped_out_bytes == 0


def test_prefetch_layers_starts_that_many_regions_back():
    x = _input()
    for depth, expected in ((1, ["host", "h2d", "device"]), (2, ["h2d", "h2d", "device"])):
        made = []
        model = Stack(_contexts(_policy("MUST_CPU_OFFLOAD"), made,
                                config=swap_pass.SwapConfig(prefetch_layers=depth)))
        loss = model(x)
        made[-1][1].__enter__()  # the last block's recompute begins ...
        made[-1][1].__exit__(None, None, None)
        assert [fwd.region.entries[0].group.stat.value for fwd, _ in made] == expected
        loss.backward()
        assert swap_pass.swap_stats().host_bytes_in_use == 0
        swap_pass.reset()


class Tail(nn.Module):
    """One block whose region output is the tagged op's own output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, context_fn):
        y = checkpoint(lambda t: self.lin(torch.tanh(t)), x, use_reentrant=False,
                       context_fn=context_fn)
        return y.square().mean()


def test_prefer_keeps_an_output_the_region_returns_and_counts_it():
    x = _input()
    ref_model = Tail()
    ref_loss = ref_model(x, lambda: (torch.utils.checkpoint.noop_context_fn()))
    ref_loss.backward()
    model = Tail()
    with pytest.warns(RuntimeWarning, match=r"aten.addmm.default\) stays on the device "
                                            r"\(shared_storage\)"):
        loss = model(x, _contexts(_policy("PREFER_CPU_OFFLOAD")))
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert torch.equal(model.lin.weight.grad, ref_model.lin.weight.grad)
    stats = swap_pass.swap_stats()
    assert stats.skipped_bytes["shared_storage"] == N * HIDDEN * 4
    assert stats.host_bytes_in_use == 0 and stats.device_bytes_released == 0


def test_must_refuses_an_output_the_region_returns_naming_the_op():
    x = _input()
    with pytest.raises(RuntimeError, match=r"swap_pass.selective_checkpoint_contexts: the output "
                                           r"of aten.addmm.default is tagged MUST_CPU_OFFLOAD"):
        Tail()(x, _contexts(_policy("MUST_CPU_OFFLOAD")))
    assert swap_pass.swap_stats().host_bytes_in_use == 0


def test_inside_no_swap_offload_tags_save_on_the_device():
    x = _input()
    ref = _step(Stack(), x)
    model = Stack(_contexts(_policy("MUST_CPU_OFFLOAD")))
    with swap_pass.no_swap():
        got = _step(model, x)
    _assert_exact(ref, got)
    stats = swap_pass.swap_stats()
    assert stats.swapped_out_bytes == 0
    assert stats.skipped_bytes["no_swap"] == OFFLOADED_BYTES


def test_a_policy_that_is_neither_function_nor_list_is_refused():
    with pytest.raises(TypeError, match="policy_fn_or_list is a int"):
        swap_pass.selective_checkpoint_contexts(3)


def test_forward_without_backward_leaves_nothing_behind():
    x = _input()
    model = Stack(_contexts(_policy("MUST_CPU_OFFLOAD")))
    loss = model(x)
    assert swap_pass.swap_stats().host_bytes_in_use > 0
    del loss  # the graph goes, and with it the groups: no collection needed
    assert swap_pass.swap_stats().host_bytes_in_use == 0


class InPlace(nn.Module):
    """A region that writes the tagged output in place after it was made."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, context_fn):
        def body(t):
            y = self.lin(t)
            y.mul_(2)
            return torch.tanh(y) + 1

        return checkpoint(body, x, use_reentrant=False, context_fn=context_fn).square().mean()


def test_an_output_written_in_place_after_its_copy_started_is_kept_as_torch_keeps_it():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    x = _input()
    ref_model, model = InPlace(), InPlace()
    ref_loss = ref_model(x, functools.partial(create_selective_checkpoint_contexts,
                                              _policy("MUST_SAVE"), True))
    ref_loss.backward()
    with pytest.warns(RuntimeWarning, match=r"\(offload_fallback\)\. .*written in place"):
        loss = model(x, _contexts(_policy("PREFER_CPU_OFFLOAD"), allow_cache_entry_mutation=True))
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert torch.equal(model.lin.weight.grad, ref_model.lin.weight.grad)
    stats = swap_pass.swap_stats()
    assert stats.skipped_bytes["offload_fallback"] == N * HIDDEN * 4
    assert stats.device_bytes_released == 0 and stats.host_bytes_in_use == 0
    with pytest.raises(RuntimeError, match="aten.addmm.default is tagged MUST_CPU_OFFLOAD but "
                                           "cannot be swapped: it was written in place"):
        model(x, _contexts(_policy("MUST_CPU_OFFLOAD"), allow_cache_entry_mutation=True))
