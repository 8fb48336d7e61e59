"""SmartSwap's two profilers, both fed by the ``saved_tensors_hooks`` pack/unpack calls.

* **Lightweight** (every step): one integer key per saved tensor from cheap features (producing
  op, module call site, dtype, shape, whether it is model state); the step's signature is the
  hash of the key sequence. Comparing signatures detects a changed operator sequence.
* **Detailed** (one step when a plan is needed): a :class:`SavedRecord` per saved tensor and a
  :class:`StorageLife` per storage (packed, could leave, read back, dropped), on one tick clock,
  so the step's memory curve replays for any choice (:func:`swap_pass.smart.policy.replay_peak`).
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from collections.abc import Iterator

import torch
from torch import nn

from swap_pass.smart.saved import state_tensors_local

__all__ = [
    "DetailedProfile",
    "FeatureTracker",
    "SavedRecord",
    "StorageLife",
    "feature_key",
    "sequence_distance",
    "state_key",
]


# --- features ---------------------------------------------------------------------------------


def op_name(tensor: torch.Tensor) -> str:
    """Name of the autograd node that produced ``tensor`` (``"leaf"`` for leaves and constants)."""
    fn = tensor.grad_fn
    return "leaf" if fn is None else type(fn).__name__


def feature_key(op: str, fqn: str, dtype: torch.dtype, shape: tuple | int, is_state: bool) -> int:
    """The integer key of one saved tensor: what fuzzy matching and the signature compare.
    With ``shape`` an ``int`` (the number of dimensions), the *structure* key, the same across
    sequence lengths and batch sizes."""
    return hash((op, fqn, dtype, shape, is_state))  # torch.Size hashes like the tuple it is


def state_key(tensor: torch.Tensor, storage: torch.UntypedStorage, state_ptrs: set[int]) -> bool:
    """The model-state feature: a leaf over a parameter or buffer storage. (Views of parameters
    carry a grad_fn and are told apart by it; skipping the storage lookup for them is cheap.)"""
    return tensor.grad_fn is None and storage.data_ptr() in state_ptrs


def sequence_distance(a: list[int], b: list[int]) -> float:
    """0.0 for equal key sequences, up to 1.0 for nothing in common (1 - difflib ratio)."""
    if a == b:
        return 0.0
    return 1.0 - difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


class FeatureTracker:
    """Keeps the fully qualified name of the innermost module running, via forward hooks.

    Args:
        model: The model whose submodules are tracked.
        max_depth: Only modules at most this deep (``"layers.1"`` is depth 2) get hooks: a call
            site that coarse is enough to tell repeated blocks apart, and every hooked module
            leaves PyTorch's hook-free fast call path. ``None`` hooks all. Default: ``2``.
        attach: Add the hooks now; else at :meth:`attach`. Default: ``True``.
    """

    def __init__(self, model: nn.Module, max_depth: int | None = 2, *,
                 attach: bool = True) -> None:
        self._model, self._max_depth = model, max_depth
        self._stack: list[str] = [""]
        self._handles = []
        self.post_forward_callbacks: list = []
        if attach:
            self.attach()

    def attach(self) -> None:
        """Add the module hooks (again after :meth:`remove`); a no-op while they are on."""
        if self._handles:
            return
        for name, module in self._model.named_modules():
            if self._max_depth is not None and name and name.count(".") + 1 > self._max_depth:
                continue
            self._handles.append(module.register_forward_pre_hook(self._make_pre(name)))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def _make_pre(self, name: str):
        def pre(module, args):
            self._stack.append(name)
        return pre

    def _post(self, module, args, output) -> None:
        if len(self._stack) > 1:
            self._stack.pop()
        for cb in self.post_forward_callbacks:
            cb()

    def in_forward(self) -> bool:
        """True while the model's forward runs (its root module entered and not yet left)."""
        return len(self._stack) > 1

    @property
    def fqn(self) -> str:
        """The module now running (``""`` outside the model)."""
        return self._stack[-1]

    def reset(self) -> None:
        """Forget an unbalanced stack (after an exception mid-forward)."""
        del self._stack[1:]

    def remove(self) -> None:
        """Remove the hooks (:meth:`attach` adds them again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


# --- detailed profile -------------------------------------------------------------------------


@dataclasses.dataclass
class SavedRecord:
    """One saved tensor of the profiled step (one pack call).

    Attributes:
        index: Forward order (pack order) in the step.
        op: Producing autograd node name (see :func:`op_name`).
        fqn: Module that was running when it was saved.
        dtype: Its dtype.
        shape: Its shape.
        nbytes: Bytes of its whole storage.
        key: :func:`feature_key` of the features above.
        storage: Ordinal of its storage in the step, or -1 for model state / non-swappable.
        bwd_order: Rank of its first unpack in backward, or -1 if never unpacked.
        cls: Structure key: :func:`feature_key` with the number of dimensions in place of the
            shape, equal across sequence lengths and batch sizes.
        tick: Tick of its pack.
    """

    index: int
    op: str
    fqn: str
    dtype: torch.dtype
    shape: tuple
    nbytes: int
    key: int
    storage: int = -1
    bwd_order: int = -1
    cls: int = 0
    tick: int = 0


@dataclasses.dataclass
class StorageLife:
    """Ticks in the life of one activation storage during the profiled step.

    Attributes:
        nbytes: Bytes of the storage.
        packed: Tick of its first pack.
        released: Tick at which nothing but autograd held it (it could leave), or None.
        unpacked: Tick of its first unpack in backward, or None.
        dropped: Tick at which autograd let go of it, or None (then: the end of the step).
        entries: Indices of the :class:`SavedRecord` s that share it.
    """

    nbytes: int
    packed: int
    released: int | None = None
    unpacked: int | None = None
    dropped: int | None = None
    entries: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DetailedProfile:
    """Everything the policy needs about one step.

    Attributes:
        records: One :class:`SavedRecord` per pack, in forward order.
        storages: One :class:`StorageLife` per activation storage, by ordinal.
        unpack_ticks: Tick of each unpack, in backward order, with the record index unpacked.
        backward_tick: Tick of the first unpack (start of backward), or None.
        end_tick: Last tick of the step.
        step_s: Wall time of the step (``step()`` to ``step()``), seconds.
        transfer_s: Seconds the executor's copies took in the step: host time on CPU, their
            own time on the side streams on an accelerator (see Note: [Timing on the device] in
            ``swap_pass/cost/probes.py``).
    """

    records: list[SavedRecord] = dataclasses.field(default_factory=list)
    storages: list[StorageLife] = dataclasses.field(default_factory=list)
    unpack_ticks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    backward_tick: int | None = None
    end_tick: int = 0
    step_s: float = 0.0
    transfer_s: float = 0.0

    @property
    def keys(self) -> list[int]:
        """Feature keys in forward order."""
        return [r.key for r in self.records]

    def saved_bytes(self) -> int:
        """Bytes of all activation storages saved in the step (the unswapped resident peak)."""
        return sum(s.nbytes for s in self.storages)

    def compute_s(self) -> float:
        """Step time without the executor's copies (never below 10% of the step)."""
        return max(self.step_s - self.transfer_s, 0.1 * self.step_s)

    def __repr__(self) -> str:  # one line; the records are in the attributes
        return (f"DetailedProfile(records={len(self.records)}, storages={len(self.storages)}, "
                f"saved_bytes={self.saved_bytes()}, step_s={self.step_s:.4f})")


def _state_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def state_storage_ptrs(model: nn.Module) -> set[int]:
    """Data pointers of the storages of the model's parameters and buffers (a ``DTensor``'s:
    its local tensor's; sparse, nested and other subclasses are left out, see saved.py)."""
    return {t.untyped_storage().data_ptr() for t in state_tensors_local(_state_tensors(model))}


def now() -> float:
    """Monotonic seconds (one place to change the clock)."""
    return time.perf_counter()
