"""Analytic device memory of one training step of the Llama-style model, per method.

Bytes per token, counted from the tensors each op of :class:`swap_pass.models.LlamaStyleModel`
keeps for backward (``h`` hidden, ``I`` MLP width, ``V`` vocabulary, ``n`` heads, ``e`` bytes
per element of the dtype; norms and the loss compute in fp32)::

    RMSNorm keeps        8h + 2he     x.float() twice (fp32 copies; in fp32 both are the input
                                      itself, so 4h + 2he), x*rsqrt, its output
    one layer keeps      2 norms + 7he + 4Ie + 4n + 8
                         qkv (3h), rotated q and k, attention output and its
                         reshaped copy; gate_up (2I), silu, the product; log-sum-exp (n, fp32)
    loss (fp32)          12V at its backward: log-softmax output, its gradient, the logits' gradient
    a layer's backward   kept + he (its output's gradient) + 2Ie (gate/up gradients, concatenated)

Peaks per method (``L`` layers; the peak is the larger of the loss's backward and the last
layer's backward):

* no swap: every layer's tensors;
* full recompute: each layer keeps only its input (``he``); one layer's tensors while it is
  recomputed;
* recompute + swap: as full recompute with three layer inputs on the device (the layer in
  backward, the one prefetched, and one not yet released; measured at 6 and 10 layers);
* SmartSwap: what its budget lets stay plus the step's transient bytes (gradients); it cannot go
  below the loss's backward (``12V + he``).

Model state: parameters, their gradients (kept between steps), optimizer state, the rotary
tables (fp32) and the batch (two int64 tensors). The step's peak is state + the activation
peak; on the bundled presets the measured peaks agree within a few percent (``swap-pass
capacity`` prints both).
"""

from __future__ import annotations

import dataclasses

__all__ = ["METHOD_KEYS", "OPTIMIZERS", "MethodMemory", "ModelShape", "method_memory",
           "param_count", "state_bytes"]

METHOD_KEYS = ("no_swap", "recompute", "eager_swap", "smartswap")
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
# Optimizer state bytes per parameter, as a function of the parameter's own bytes ``e``.
OPTIMIZERS = {
    # torch.optim.SGD without momentum (what the bench trains with)
    "sgd": lambda e: 0,
    "sgd-momentum": lambda e: e,        # one momentum buffer in the parameter's dtype
    "adam": lambda e: 2 * e,            # exp_avg and exp_avg_sq in the parameter's dtype
    "adam-mixed": lambda e: 12,         # fp32 master weights, exp_avg, exp_avg_sq
}
# Layer inputs recompute + swap keeps on the device during a layer's backward.
SWAP_RESIDENT_INPUTS = 3


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-style model and of one training step.

    Args:
        hidden: Hidden size ``h``.
        layers: Decoder layers ``L``.
        heads: Attention heads.
        intermediate: MLP width ``I``.
        vocab: Vocabulary size ``V``.
        seq: Sequence length.
        batch: Micro-batch size. Default: ``1``.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``. Default: ``"bf16"``.
        optimizer: A key of :data:`OPTIMIZERS`. Default: ``"sgd"``.
        micro_batches: Micro-batches whose activations are kept at once (pipeline). Default: ``1``.
        max_seq_len: Rows of the rotary tables; ``seq`` when None. Default: ``None``.
    """

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    seq: int
    batch: int = 1
    dtype: str = "bf16"
    optimizer: str = "sgd"
    micro_batches: int = 1
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch",
                     "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"swap_pass.capacity: {name}={value!r} is invalid. "
                                 "It must be an int >= 1.")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"swap_pass.capacity: dtype={self.dtype!r} is unknown. "
                             f"It must be one of {sorted(_ITEMSIZE)}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"swap_pass.capacity: optimizer={self.optimizer!r} is unknown. "
                             f"It must be one of {sorted(OPTIMIZERS)}.")

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return _ITEMSIZE[self.dtype]

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch * self.seq

    @classmethod
    def from_preset(cls, preset, optimizer: str = "sgd") -> ModelShape:
        """The shape of a :class:`swap_pass.bench.presets.BenchPreset`."""
        m = preset.model
        return cls(hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
                   intermediate=m.intermediate_size, vocab=m.vocab_size, seq=preset.seq,
                   batch=preset.batch, dtype=preset.dtype, optimizer=optimizer,
                   max_seq_len=m.max_seq_len)


@dataclasses.dataclass(frozen=True)
class MethodMemory:
    """Predicted bytes of one method's training step.

    Attributes:
        state_bytes: Parameters, gradients, optimizer state, buffers, the batch.
        activation_bytes: Peak bytes above the state during the step.
        host_bytes: Host memory the method holds (swapped tensors); 0 without swap.
        transient_bytes: Part of ``activation_bytes`` that is not kept for backward (gradients
            in flight): the working margin SmartSwap's budget leaves.
    """

    state_bytes: int
    activation_bytes: int
    host_bytes: int
    transient_bytes: int

    @property
    def peak_bytes(self) -> int:
        """State plus the activation peak."""
        return self.state_bytes + self.activation_bytes


def param_count(s: ModelShape) -> int:
    """Parameters: embedding, per layer qkv, output, gate/up, down and two norms, final norm,
    LM head."""
    h, i = s.hidden, s.intermediate
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    return 2 * s.vocab * h + s.layers * per_layer + h


def state_bytes(s: ModelShape) -> int:
    """Bytes resident at the step's start: parameters, gradients, optimizer state, rotary tables,
    batch."""
    params = param_count(s)
    rotary = 2 * (s.max_seq_len or s.seq) * (s.hidden // s.heads // 2) * 4
    batch = 2 * s.tokens * 8 * s.micro_batches
    return params * (2 * s.itemsize + OPTIMIZERS[s.optimizer](s.itemsize)) + rotary + batch


def _per_token(s: ModelShape) -> dict[str, int]:
    h, e, i = s.hidden, s.itemsize, s.intermediate
    norm = (4 * h if e == 4 else 8 * h) + 2 * h * e
    return {
        "layer": 2 * norm + 7 * h * e + 4 * i * e + 4 * s.heads + 8,
        "norm": norm,
        "input": h * e,
        "input_alias": 4 * h if e == 4 else 0,  # in fp32 the first norm keeps the input itself
        "loss_kept": 4 * s.vocab,
        "loss_grads": 8 * s.vocab,
        "layer_grads": h * e + 2 * i * e,
        "layer_grads_in_flight": h * e + 4 * i * e,
    }


def _points(s: ModelShape, kept_inputs_layer: int, kept_inputs_loss: int,
            recompute: bool) -> tuple[int, int]:
    """Per-token (kept, transient) at the loss's backward and at the last layer's backward."""
    t, mb = _per_token(s), s.micro_batches
    if recompute:
        layers_kept = kept_inputs_layer * t["input"]
        at_layer = mb * layers_kept + t["layer"] - t["input_alias"]
        at_loss = mb * kept_inputs_loss * t["input"] + t["norm"] + t["loss_kept"]
    else:
        at_layer = at_loss = mb * s.layers * t["layer"]
        at_loss += t["norm"] + t["loss_kept"]
    return (max(at_loss + t["loss_grads"], at_layer + t["layer_grads"]),
            max(t["loss_grads"], t["layer_grads"]))


def _smartswap(s: ModelShape, budget_bytes: int | None) -> tuple[int, int]:
    """SmartSwap's activation peak and transient bytes: its budget plus the transient, at least
    its floor."""
    t = _per_token(s)
    transient = max(t["loss_grads"], t["layer_grads_in_flight"]) * s.tokens
    floor = (t["loss_kept"] + t["loss_grads"] + t["input"]) * s.tokens
    budget = 0 if budget_bytes is None else max(budget_bytes, 0)
    return max(floor, budget + transient), transient


def saved_bytes(s: ModelShape) -> int:
    """Bytes every layer, the final norm and the loss keep for backward without recompute."""
    t = _per_token(s)
    return (s.layers * t["layer"] + t["norm"] + t["loss_kept"]) * s.tokens * s.micro_batches


def method_memory(s: ModelShape, method: str,
                  smart_budget_bytes: int | None = None) -> MethodMemory:
    """Predicted state, activation peak and host bytes of ``method`` (a key of :data:`METHOD_KEYS`).

    Args:
        smart_budget_bytes: SmartSwap's ``memory_budget`` in bytes (kept saved activations).
            Default: ``None`` (its floor).
    """
    state = state_bytes(s)
    if method == "smartswap":
        peak, transient = _smartswap(s, smart_budget_bytes)
        return MethodMemory(state, peak, saved_bytes(s), transient)
    if method not in METHOD_KEYS:
        raise ValueError(f"swap_pass.capacity: method {method!r} has no memory model. "
                         f"It must be one of {METHOD_KEYS}.")
    swap = method == "eager_swap"
    resident = min(SWAP_RESIDENT_INPUTS, s.layers) if swap else s.layers
    per_token, transient = _points(s, resident, 1 if swap else s.layers,
                                   recompute=method != "no_swap")
    host = (s.layers - 1) * _per_token(s)["input"] * s.tokens * s.micro_batches if swap else 0
    return MethodMemory(state, per_token * s.tokens, host, transient * s.tokens)
