"""Test helpers for SmartSwap: an independent counter of resident saved bytes, and runs to compare."""

from __future__ import annotations

import copy
import weakref

import torch

from swap_pass.models import LlamaConfig, LlamaStyleModel, make_batch


class SavedBytesCounter:
    """Resident bytes of saved activation storages, read from the storages themselves.

    Installed inside whatever saved-tensor hooks are active (SmartSwap's or none), it passes every
    pack and unpack through to them and keeps only weak references to the storages it saw. After
    each pack and around each unpack it sums ``untyped_storage().nbytes()`` of the distinct live
    storages that are not model state: a freed storage reads 0 bytes, so nothing here trusts
    SmartSwap's own bookkeeping.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0
        self.samples: list[int] = []
        self._hooks = None

    def __enter__(self) -> SavedBytesCounter:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (lambda t: t, lambda t: t)

        def counted_pack(t):
            if t.untyped_storage().data_ptr() not in self.state:
                s = t.untyped_storage()
                self.storages[s._cdata] = weakref.ref(s)
            handle = pack(t)
            self.sample()
            return handle

        def counted_unpack(h):
            self.sample()
            t = unpack(h)
            self.sample()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(counted_pack, counted_unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def resident(self) -> int:
        """Bytes of the saved storages now allocated."""
        live = (ref() for ref in self.storages.values())
        return sum(s.nbytes() for s in live if s is not None)

    def sample(self) -> int:
        now = self.resident()
        self.samples.append(now)
        self.peak = max(self.peak, now)
        return now


def tiny_model(seed: int = 0, **cfg) -> LlamaStyleModel:
    torch.manual_seed(seed)
    return LlamaStyleModel(LlamaConfig(**cfg))


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def baseline_step(model, batch, seq, seed=0):
    """Loss, grads and counted saved-bytes peak of one step without swap (on a deep copy)."""
    ref = copy.deepcopy(model)
    ids, labels = make_batch(ref.cfg, batch, seq, seed=seed)
    with SavedBytesCounter(ref) as counter:
        loss = ref(ids, labels)
        counter.sample()
        loss.backward()
    return loss.detach(), grads_of(ref), counter.peak


def assert_grads_equal(model, expected) -> None:
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)
