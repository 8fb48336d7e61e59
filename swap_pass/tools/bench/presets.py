"""Benchmark presets: one model size, batch and step count per name."""

from __future__ import annotations

import dataclasses

import torch

from swap_pass.cost.model import DTYPES
from swap_pass.tools.memory_model import layer_input_bytes
from swap_pass.tools.models import LlamaConfig

__all__ = ["PRESETS", "BenchPreset", "get_preset"]


@dataclasses.dataclass(frozen=True)
class BenchPreset:
    """A model size and a step schedule for ``swap-pass bench`` and ``swap-pass demo``.

    Args:
        name: Preset name.
        model: Model sizes.
        batch: Micro-batch size. Default: ``2``.
        seq: Sequence length. Default: ``256``.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` for weights and activations.
            Default: ``"fp32"``.
        warmup_steps: Untimed steps first (allocator, pool and compile warm-up). Default: ``2``.
        timed_steps: Steps whose wall time is measured. Default: ``3``.
        note: What the preset is for. Default: ``""``.
    """

    name: str
    model: LlamaConfig
    batch: int = 2
    seq: int = 256
    dtype: str = "fp32"
    warmup_steps: int = 2
    timed_steps: int = 3
    note: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The preset's dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]

    @property
    def layer_input_bytes(self) -> int:
        """Bytes of one layer input (``batch * seq * hidden * itemsize``)."""
        return layer_input_bytes(self.batch, self.seq, self.model.hidden_size, self.dtype)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one training step consumes."""
        return self.batch * self.seq

    def resized(self, **changes) -> BenchPreset:
        """A copy with model fields (``hidden_size``, ``num_layers``...) or preset fields
        changed."""
        model_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        model_changes = {k: v for k, v in changes.items() if k in model_fields}
        own = {k: v for k, v in changes.items() if k not in model_fields}
        model = dataclasses.replace(self.model, **model_changes) if model_changes else self.model
        return dataclasses.replace(self, model=model, **own)


PRESETS: dict[str, BenchPreset] = {
    "tiny": BenchPreset(
        name="tiny",
        model=LlamaConfig(vocab_size=256, hidden_size=32, num_layers=6, num_heads=4,
                          intermediate_size=88, max_seq_len=1024),
        batch=4, seq=256, dtype="fp32", warmup_steps=1, timed_steps=3,
        note="CPU default: 6 layers, hidden 32, seq 256: compile time grows with the layer count, "
             "so the four compile rows fit in the bench's minute on 2 cores; "
             "a layer input (128 KiB) "
             "is 2.6x a layer's parameter gradients, which compiled backward holds all at once, so "
             "what swap removes shows in the compiled peaks too",
    ),
    "llama-8b-layer": BenchPreset(
        name="llama-8b-layer",
        model=LlamaConfig(vocab_size=8192, hidden_size=4096, num_layers=8, num_heads=32,
                          intermediate_size=14336, max_seq_len=4096),
        batch=1, seq=4096, dtype="bf16", warmup_steps=2, timed_steps=5,
        note="GPU: 8 layers of Llama-3-8B size (hidden 4096, MLP 14336, 32 heads), seq 4096, bf16; "
             "vocabulary cut to 8192 so the LM head does not dominate",
    ),
}


def get_preset(name: str) -> BenchPreset:
    """The preset called ``name``.

    Raises:
        ValueError: naming the known presets.
    """
    if name not in PRESETS:
        raise ValueError(f"swap_pass.tools.bench: preset {name!r} is unknown. "
                         f"It must be one of {sorted(PRESETS)}.")
    return PRESETS[name]
