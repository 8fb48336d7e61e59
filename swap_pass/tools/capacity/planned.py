"""The planned capacity: the same search as ``swap-pass capacity``, each probe a formula.

For every method, the largest size (batch, sequence or hidden) whose predicted peak
(:func:`swap_pass.tools.memory_model.method_memory`) fits the device memory and whose host bytes fit
the host limit. ``swap-pass plan --device-memory`` prints it for a full-size model;
``swap-pass capacity`` starts each method's measured search from it and prints the planned peak
next to the measured one.
"""

from __future__ import annotations

import dataclasses

from swap_pass.tools.bench.presets import BenchPreset
from swap_pass.tools.capacity.search import largest_fitting
from swap_pass.tools.memory_model import METHOD_KEYS, MethodMemory, ModelShape, method_memory

__all__ = ["DIMS", "METHOD_LABELS", "PlannedRow", "dim_quantum", "plan_capacity", "planned_memory",
           "sized_preset", "smart_budget"]

DIMS = ("batch", "seq", "hidden")
METHOD_LABELS = {"no_swap": "no swap", "recompute": "full recompute",
                 "eager_swap": "recompute + swap", "smartswap": "SmartSwap"}


@dataclasses.dataclass(frozen=True)
class PlannedRow:
    """One method's planned answer.

    Attributes:
        max: Largest size that fits (0: none).
        limited_by: ``"device"``, ``"host"`` (host memory ran out first) or ``"search range"``.
        memory: Predicted bytes at ``max`` (at size 1 when nothing fits).
        need_without_swap_bytes: What no swap would need at ``max``.
    """

    method: str
    label: str
    max: int
    limited_by: str
    memory: MethodMemory
    need_without_swap_bytes: int


def dim_quantum(preset: BenchPreset, dim: str) -> int:
    """Sizes are multiples of this: 1, or for ``hidden`` twice the heads (an even rotary head
    size)."""
    return 2 * preset.model.num_heads if dim == "hidden" else 1


def sized_preset(preset: BenchPreset, dim: str, units: int) -> BenchPreset:
    """``preset`` with ``dim`` set to ``units * dim_quantum``; the MLP width scales with hidden."""
    value = units * dim_quantum(preset, dim)
    if dim == "batch":
        return preset.resized(batch=value)
    if dim == "seq":
        return preset.resized(seq=value, max_seq_len=max(value, preset.model.max_seq_len))
    if dim == "hidden":
        scaled = max(1, round(preset.model.intermediate_size * value / preset.model.hidden_size))
        return preset.resized(hidden_size=value, intermediate_size=scaled)
    raise ValueError(f"swap_pass.tools.capacity: dim={dim!r} is unknown. It must be one of "
                     f"{list(DIMS)}.")


def smart_budget(shape: ModelShape, cap_bytes: int) -> int:
    """SmartSwap's budget under ``cap_bytes``: the cap less the model state and the step's
    transient bytes."""
    planned = method_memory(shape, "smartswap")
    return cap_bytes - planned.state_bytes - planned.transient_bytes


def planned_memory(shape: ModelShape, method: str, cap_bytes: int) -> MethodMemory:
    """``method``'s predicted bytes at ``shape``; SmartSwap at the budget derived from the cap."""
    budget = smart_budget(shape, cap_bytes) if method == "smartswap" else None
    return method_memory(shape, method, budget)


def _fits(memory: MethodMemory, cap_bytes: int, host_bytes: int, method: str) -> bool:
    budget_left = method != "smartswap" or memory.activation_bytes > memory.transient_bytes
    return memory.peak_bytes <= cap_bytes and memory.host_bytes <= host_bytes and budget_left


def plan_capacity(preset: BenchPreset, dim: str, cap_bytes: int, host_bytes: int, *,
                  methods: tuple[str, ...] = METHOD_KEYS, optimizer: str = "sgd",
                  micro_batches: int = 1, limit: int = 1 << 20) -> list[PlannedRow]:
    """Planned largest size per method under ``cap_bytes`` of device and ``host_bytes`` of host
    memory.

    Args:
        limit: Largest size (in units of :func:`dim_quantum`) searched. Default: ``2**20``.
    """
    def shape(units: int) -> ModelShape:
        sized = sized_preset(preset, dim, units)
        return dataclasses.replace(ModelShape.from_preset(sized, optimizer),
                                   micro_batches=micro_batches)

    rows = []
    for m in methods:
        def fits(units: int, host: int = host_bytes, m: str = m) -> bool:
            return _fits(planned_memory(shape(units), m, cap_bytes), cap_bytes, host, m)

        best = largest_fitting(fits, 1, limit)
        unlimited_host = largest_fitting(lambda u: fits(u, host=2**62), max(best, 1), limit)
        at = shape(max(best, 1))
        limited = "search range" if best == limit else "host" if unlimited_host > best else "device"
        rows.append(PlannedRow(m, METHOD_LABELS[m], best * dim_quantum(preset, dim), limited,
                               planned_memory(at, m, cap_bytes),
                               method_memory(at, "no_swap").peak_bytes))
    return rows
