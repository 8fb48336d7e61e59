"""The memory model of a Transformer training step: the model shape and each method's peak.

``swap-pass plan`` (:mod:`swap_pass.tools.plan`), the capacity search
(:mod:`swap_pass.tools.capacity`) and the bench presets take bytes and times from here; the
dtype table and the per-op formulas it builds on are the library's (:mod:`swap_pass.cost.model`,
which budget mode and SmartSwap read).

One layer (``b`` batch, ``s`` sequence, ``h`` hidden, ``e`` bytes per element, ``L`` layers)::

    layer input          b*s*h*e         hidden_states: all a layer keeps with full recompute
    forward FLOPs        24*b*s*h^2 + 4*b*s^2*h
    backward             2x the forward, plus one forward when the layer is recomputed
    copy time            bytes / bandwidth;  compute time: FLOPs / FLOP rate
    inputs on device     L without swap; min(3, L) with recompute + swap (the layer in
                         backward, the one prefetched and one not yet released; measured at
                         6 and 10 layers), per micro-batch in flight
    host memory          L - 1 layer inputs per micro-batch (the last layer's input is used at
                         once by backward: never swapped)

One training step of :class:`swap_pass.tools.models.LlamaStyleModel`, bytes per token, counted from
the tensors each op keeps for backward (``I`` MLP width, ``V`` vocabulary, ``n`` heads; norms
and the loss compute in fp32)::

    RMSNorm keeps        8h + 2he     x.float() twice (fp32 copies; in fp32 both are the input
                                      itself, so 4h + 2he), x*rsqrt, its output
    one layer keeps      2 norms + 7he + 4Ie + 4n + 8
                         qkv (3h), rotated q and k, attention output and its
                         reshaped copy; gate_up (2I), silu, the product; log-sum-exp (n, fp32)
    loss (fp32)          12V at its backward: log-softmax output, its gradient, the logits' gradient
    a layer's backward   kept + he (its output's gradient) + 2Ie (gate/up gradients, concatenated)

Peaks per method (the peak is the larger of the loss's backward and the last layer's backward):

* no swap: every layer's tensors;
* full recompute: each layer keeps only its input (``he``); one layer's tensors while it is
  recomputed;
* recompute + swap: as full recompute with :data:`SWAP_RESIDENT_INPUTS` layer inputs on the
  device;
* SmartSwap: what its budget lets stay plus the step's transient bytes (gradients); it cannot go
  below the loss's backward (``12V + he``).

Model state: parameters, their gradients (kept between steps), optimizer state, the rotary
tables (fp32) and the batch (two int64 tensors). The step's peak is state + the activation
peak; on the bundled presets the measured peaks agree within a few percent (``swap-pass
capacity`` prints both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from swap_pass.cost.model import BACKWARD_PER_FORWARD, DTYPES, itemsize

__all__ = ["METHOD_KEYS", "OPTIMIZERS", "SWAP_RESIDENT_INPUTS", "TRAINING_DTYPES", "MethodMemory",
           "ModelShape", "layer_backward_seconds", "layer_forward_flops", "layer_input_bytes",
           "method_memory", "param_count", "resident_layer_inputs", "saved_bytes", "state_bytes",
           "swap_host_bytes"]

# The dtypes :class:`swap_pass.tools.models.LlamaStyleModel` trains in: the whole-step model's.
TRAINING_DTYPES = ("fp32", "bf16", "fp16")


# --- validation shared with the commands' own inputs --------------------------------------------


def check_counts(owner: str, **values: object) -> None:
    """Raise ``ValueError`` naming ``owner`` unless every value is an int >= 1."""
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name}={value!r} is invalid. It must be an int >= 1.")


def check_dtype(owner: str, dtype: str, allowed: Sequence[str] = tuple(DTYPES)) -> None:
    """Raise ``ValueError`` naming ``owner`` unless ``dtype`` is one of ``allowed``."""
    if dtype not in allowed:
        raise ValueError(f"{owner}: dtype={dtype!r} is unknown. "
                         f"It must be one of {sorted(allowed)}.")


# --- the model shape --------------------------------------------------------------------------

# Optimizer state bytes per parameter, as a function of the parameter's own bytes ``e``.
OPTIMIZERS = {
    # torch.optim.SGD without momentum (what the bench trains with)
    "sgd": lambda e: 0,
    "sgd-momentum": lambda e: e,        # one momentum buffer in the parameter's dtype
    "adam": lambda e: 2 * e,            # exp_avg and exp_avg_sq in the parameter's dtype
    "adam-mixed": lambda e: 12,         # fp32 master weights, exp_avg, exp_avg_sq
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-style Transformer and of one training step.

    The layer-level formulas need ``hidden``, ``layers``, ``seq``, ``batch`` and ``dtype``; the
    whole step (:func:`method_memory`) also needs ``heads``, ``intermediate`` and ``vocab``.
    Arguments after ``seq`` are keyword-only.

    Args:
        hidden: Hidden size ``h``.
        layers: Decoder layers ``L``.
        seq: Sequence length.
        batch: Micro-batch size. Default: ``1``.
        dtype: A name of :data:`DTYPES`. Default: ``"bf16"``.
        micro_batches: Micro-batches whose activations are kept at once (pipeline). Default: ``1``.
        heads: Attention heads. Default: ``None``.
        intermediate: MLP width ``I``. Default: ``None``.
        vocab: Vocabulary size ``V``. Default: ``None``.
        optimizer: A key of :data:`OPTIMIZERS`. Default: ``"sgd"``.
        max_seq_len: Rows of the rotary tables; ``seq`` when None. Default: ``None``.
    """

    hidden: int
    layers: int
    seq: int
    _: dataclasses.KW_ONLY
    batch: int = 1
    dtype: str = "bf16"
    micro_batches: int = 1
    heads: int | None = None
    intermediate: int | None = None
    vocab: int | None = None
    optimizer: str = "sgd"
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        owner = "swap_pass.ModelShape"
        check_counts(owner, hidden=self.hidden, layers=self.layers, seq=self.seq,
                     batch=self.batch, micro_batches=self.micro_batches)
        check_counts(owner, **{name: value for name in ("heads", "intermediate", "vocab",
                                                         "max_seq_len")
                               if (value := getattr(self, name)) is not None})
        check_dtype(owner, self.dtype)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"{owner}: optimizer={self.optimizer!r} is unknown. "
                             f"It must be one of {sorted(OPTIMIZERS)}.")

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return itemsize(self.dtype)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch * self.seq

    @property
    def layer_input_bytes(self) -> int:
        """Bytes of one layer input of one micro-batch (:func:`layer_input_bytes`)."""
        return layer_input_bytes(self.batch, self.seq, self.hidden, self.dtype)

    @classmethod
    def from_preset(cls, preset, optimizer: str = "sgd") -> ModelShape:
        """The shape of a :class:`swap_pass.tools.bench.presets.BenchPreset`."""
        m = preset.model
        return cls(hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
                   intermediate=m.intermediate_size, vocab=m.vocab_size, seq=preset.seq,
                   batch=preset.batch, dtype=preset.dtype, optimizer=optimizer,
                   max_seq_len=m.max_seq_len)


# --- one layer --------------------------------------------------------------------------------

# Layer inputs recompute + swap keeps on the device during a layer's backward, per micro-batch.
SWAP_RESIDENT_INPUTS = 3


def layer_input_bytes(batch: int, seq: int, hidden: int, dtype: str | torch.dtype) -> int:
    """Bytes of one layer input (``hidden_states``): ``batch * seq * hidden * itemsize``."""
    return batch * seq * hidden * itemsize(dtype)


def layer_forward_flops(batch: int, seq: int, hidden: int) -> float:
    """Forward FLOPs of one Transformer layer: ``24*b*s*h^2 + 4*b*s^2*h``."""
    return 24.0 * batch * seq * hidden**2 + 4.0 * batch * seq**2 * hidden


def layer_backward_seconds(forward_s: float, recompute: bool) -> float:
    """A layer's backward time: :data:`BACKWARD_PER_FORWARD` forwards, one more to recompute."""
    return (BACKWARD_PER_FORWARD + (1.0 if recompute else 0.0)) * forward_s


def resident_layer_inputs(layers: int, swap: bool, micro_batches: int = 1) -> int:
    """Layer inputs on the device at the step's peak with full recompute: all ``layers``
    without swap, at most :data:`SWAP_RESIDENT_INPUTS` with it; per micro-batch in flight."""
    return (min(SWAP_RESIDENT_INPUTS, layers) if swap else layers) * micro_batches


def swap_host_bytes(s: ModelShape) -> int:
    """Host bytes recompute + swap holds: every layer input but the last, per micro-batch."""
    return (s.layers - 1) * s.layer_input_bytes * s.micro_batches


# --- one training step of LlamaStyleModel -------------------------------------------------------

METHOD_KEYS = ("no_swap", "recompute", "eager_swap", "smartswap")


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


def _whole_step(s: ModelShape) -> ModelShape:
    """``s``, checked to have what the whole-step model needs."""
    missing = [n for n in ("heads", "intermediate", "vocab") if getattr(s, n) is None]
    if missing:
        raise ValueError(f"swap_pass.ModelShape: {', '.join(missing)} not given. The memory "
                         "model of a whole step needs heads, intermediate and vocab.")
    if s.dtype not in TRAINING_DTYPES:
        raise ValueError(f"swap_pass.ModelShape: dtype={s.dtype!r} has no whole-step memory "
                         f"model. It must be one of {sorted(TRAINING_DTYPES)}.")
    return s


def param_count(s: ModelShape) -> int:
    """Parameters: embedding, per layer qkv, output, gate/up, down and two norms, final norm,
    LM head."""
    h, i = s.hidden, _whole_step(s).intermediate
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
    h, e, i = s.hidden, s.itemsize, _whole_step(s).intermediate
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
        raise ValueError(f"swap_pass.method_memory: method {method!r} has no memory model. "
                         f"It must be one of {METHOD_KEYS}.")
    swap = method == "eager_swap"
    per_token, transient = _points(s, resident_layer_inputs(s.layers, swap),
                                   1 if swap else s.layers, recompute=method != "no_swap")
    host = swap_host_bytes(s) if swap else 0
    return MethodMemory(state, per_token * s.tokens, host, transient * s.tokens)
