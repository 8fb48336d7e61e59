"""``swap-pass plan``: will swapping each layer's input pay off, and can the copies hide?

For a Transformer of ``layers`` layers, batch ``b``, sequence ``s`` and hidden size ``h``, the
layer input (``hidden_states``) is ``b*s*h*bytes(dtype)``. With full recompute it is the only
thing a layer keeps for backward; swapping it leaves at most
:data:`~swap_pass.tools.memory_model.SWAP_RESIDENT_INPUTS` (three) of them on the device per
micro-batch.

A copy hides behind compute when it takes no longer than the compute it overlaps::

    forward:   D2H of layer i's input   overlaps  forward of layer i+1
               time_fwd = (24*b*s*h^2 + 4*b*s^2*h) / achieved FLOP/s
    backward:  H2D of layer i-1's input overlaps  backward of layer i
               time_bwd = 2 * time_fwd  (+ time_fwd for the recompute)

The bytes, times and layer-input counts are :mod:`swap_pass.tools.memory_model`'s, the same that
``swap-pass capacity`` plans with; this module lays them out for one model.

# Note: [One place for the simulator]
# Every number ``plan`` prints comes from :func:`simulate`. Besides the closed forms above it
# runs SmartSwap's simulator (``swap_pass.smart.policy.simulate``, the one SmartSwap's policy
# scores its plans with) on the same per-layer times and bytes, when that module is in the build:
# its stall and peak are printed next to the closed forms. :func:`_smart_simulation` is the single
# place that calls it.
"""

from __future__ import annotations

import dataclasses
import math

from swap_pass.cost.model import compute_seconds, copy_seconds
from swap_pass.smart.policy import simulate as smart_simulate
from swap_pass.tools.memory_model import (
    ModelShape,
    check_counts,
    check_dtype,
    layer_backward_seconds,
    layer_forward_flops,
    resident_layer_inputs,
    swap_host_bytes,
)

__all__ = ["PlanInputs", "PlanResult", "format_plan", "simulate"]


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What ``swap-pass plan`` is asked about.

    Args:
        hidden: Hidden size ``h``.
        seq: Sequence length ``s``.
        layers: Number of Transformer layers ``L``.
        batch: Micro-batch size ``b``. Default: ``1``.
        dtype: Activation dtype name (``bf16``, ``fp16``, ``fp32``, ``fp8``). Default: ``"bf16"``.
        bandwidth_gbs: Host-device copy bandwidth in GB/s (10^9 bytes/s). Default: ``25.0``.
        tflops: Achieved (not peak) TFLOP/s of the device. Default: ``300.0``.
        micro_batches: Micro-batches in flight per layer (pipeline parallel). Default: ``1``.
        recompute: Full recompute (the layer input is all a layer keeps). Default: ``True``.
    """

    hidden: int
    seq: int
    layers: int
    batch: int = 1
    dtype: str = "bf16"
    bandwidth_gbs: float = 25.0
    tflops: float = 300.0
    micro_batches: int = 1
    recompute: bool = True

    def __post_init__(self) -> None:
        check_counts("swap_pass.tools.plan", hidden=self.hidden, seq=self.seq, layers=self.layers,
                     batch=self.batch, micro_batches=self.micro_batches)
        for name in ("bandwidth_gbs", "tflops"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"swap_pass.tools.plan: {name}={value!r} is invalid. It must be a number > 0.")
        check_dtype("swap_pass.tools.plan", self.dtype)

    @property
    def shape(self) -> ModelShape:
        """The model shape these inputs describe."""
        return ModelShape(hidden=self.hidden, layers=self.layers, seq=self.seq, batch=self.batch,
                          dtype=self.dtype, micro_batches=self.micro_batches)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """What :func:`simulate` predicts (bytes, seconds, booleans)."""

    layer_input_bytes: int
    swapped_layers: int
    host_bytes_needed: int
    resident_inputs_without_swap: int
    resident_inputs_with_swap: int
    device_bytes_saved: int
    layer_forward_flops: float
    layer_forward_s: float
    layer_backward_s: float
    d2h_s: float
    h2d_s: float
    d2h_hidden: bool
    h2d_hidden: bool
    sim_stall_s: float | None = None
    sim_peak_bytes: int | None = None
    sim_source: str = ""

    @property
    def hides(self) -> bool:
        """True when both directions fit in the compute they overlap."""
        return self.d2h_hidden and self.h2d_hidden


def _smart_simulation(p: PlanInputs, per_layer: int, t_fwd: float, t_bwd: float) -> dict:
    """Stall and peak of one micro-batch's step from SmartSwap's simulator."""
    n = p.layers
    swap = [per_layer] * (n - 1) + [0]  # the last layer's input stays on the device
    resident = [0] * (n - 1) + [per_layer]
    bw = p.bandwidth_gbs * 1e9
    sim = smart_simulate([t_fwd] * n, [t_bwd] * n, resident, swap, d2h_bandwidth=bw,
                         h2d_bandwidth=bw, prefetch_depth=1)
    return {"sim_stall_s": sim.stall_s, "sim_peak_bytes": sim.peak_bytes,
            "sim_source": "swap_pass.smart.policy.simulate"}


def simulate(inputs: PlanInputs) -> PlanResult:
    """Predict bytes and copy/compute overlap for swapping every layer input but the last.

    See ``# Note: [One place for the simulator]`` in this module.
    """
    p, shape = inputs, inputs.shape
    per_layer = shape.layer_input_bytes
    resident_with = resident_layer_inputs(p.layers, swap=True, micro_batches=p.micro_batches)
    resident_without = resident_layer_inputs(p.layers, swap=False, micro_batches=p.micro_batches)
    fwd_flops = layer_forward_flops(p.batch, p.seq, p.hidden)
    t_fwd = compute_seconds(fwd_flops, p.tflops * 1e12)
    t_bwd = layer_backward_seconds(t_fwd, p.recompute)
    t_copy = copy_seconds(per_layer, p.bandwidth_gbs * 1e9)
    return PlanResult(
        layer_input_bytes=per_layer,
        swapped_layers=p.layers - 1,  # the last layer's input is used at once by backward
        host_bytes_needed=swap_host_bytes(shape),
        resident_inputs_without_swap=resident_without,
        resident_inputs_with_swap=resident_with,
        device_bytes_saved=(resident_without - resident_with) * per_layer,
        layer_forward_flops=fwd_flops,
        layer_forward_s=t_fwd,
        layer_backward_s=t_bwd,
        d2h_s=t_copy,
        h2d_s=t_copy,
        d2h_hidden=t_copy <= t_fwd,
        h2d_hidden=t_copy <= t_bwd,
        **_smart_simulation(p, per_layer, t_fwd, t_bwd),
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _ms(t: float) -> str:
    return f"{t * 1e3:,.3f} ms"


def _verdict(copy_s: float, window_s: float) -> str:
    if copy_s <= window_s:
        return f"hidden (copy uses {copy_s / window_s:.0%} of the window)"
    return f"NOT hidden: stalls ~{_ms(copy_s - window_s)} per layer"


def _simulation_rows(r: PlanResult) -> list[tuple[str, str]]:
    if r.sim_stall_s is None:
        return [("SmartSwap simulator", r.sim_source)]
    return [("simulated stall per step (SmartSwap sim)", _ms(r.sim_stall_s)),
            ("simulated peak layer inputs on device", _mib(r.sim_peak_bytes))]


def format_plan(inputs: PlanInputs, result: PlanResult) -> str:
    """The plan as a two-column text table."""
    p, r = inputs, result
    bwd = "backward + recompute" if p.recompute else "backward"
    rows = [
        ("layer input (b*s*h*bytes)", _mib(r.layer_input_bytes)),
        ("layers swapped (all but the last)",
         f"{r.swapped_layers} x {p.micro_batches} micro-batch(es)"),
        ("host memory needed (pinned)", _mib(r.host_bytes_needed)),
        ("layer inputs on device at the peak, no swap", f"{r.resident_inputs_without_swap}"),
        ("layer inputs on device at the peak, swap", f"<= {r.resident_inputs_with_swap}"),
        ("device memory saved", _mib(r.device_bytes_saved)),
        ("layer forward FLOPs (24bsh^2+4bs^2h)", f"{r.layer_forward_flops:.3e}"),
        (f"layer forward @ {p.tflops:g} TFLOP/s", _ms(r.layer_forward_s)),
        (f"layer {bwd}", _ms(r.layer_backward_s)),
        (f"one copy @ {p.bandwidth_gbs:g} GB/s", _ms(r.d2h_s)),
        ("D2H vs next layer's forward", _verdict(r.d2h_s, r.layer_forward_s)),
        (f"H2D vs next layer's {bwd}", _verdict(r.h2d_s, r.layer_backward_s)),
    ]
    rows += _simulation_rows(r)
    width = max(len(k) for k, _ in rows)
    head = (f"swap-pass plan: hidden={p.hidden} seq={p.seq} layers={p.layers} batch={p.batch} "
            f"dtype={p.dtype} micro_batches={p.micro_batches}")
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])
