"""Budget mode of ``swap_backend``: choose which saved tensors to swap so the step fits a budget.

The forward and backward graphs from the partitioner are laid end to end on one timeline (the
forward's nodes, then the backward's). Every tensor a node makes is a *storage* (views share the
storage of their base); a storage lives from the node that makes it to the last node that reads
it or any view of it, and a tensor saved for backward lives on to its last backward reader. The
predicted peak is the largest sum of live storage bytes at any point (graph inputs such as
parameters are resident and not counted).

Swapping a saved tensor ``x`` (any of them, not only a layer's input) ends its forward life at
the ``wait`` after its D2H copy and starts its backward life at the ``prefetch`` of its H2D copy::

    forward:   x made -- swap_out -- ...compute >= copy time... last reader -- wait   (x freed)
    backward:  prefetch -- ...compute >= copy time... -- wait -- first reader of x

A tensor whose copy cannot hide (too little compute between its producer and the forward's end,
or between the backward's start and its first reader) is never chosen. Compute time is each
node's matmul-class FLOPs (``torch.utils.flop_counter``) over the device's FLOP rate, copy time
bytes over the host link bandwidth (:mod:`swap_pass.cost.model`'s formulas, shared with
``swap-pass plan`` and SmartSwap's simulator). Rates not given (:class:`CostModel`) are measured
on the graph's device, the FLOP rate in its matmuls' dtype, by :mod:`swap_pass.cost.probes`: on
real tensors even under the compiler's fake mode, once per device and dtype in a process (see
Note: [Throughput probe], Note: [Probes run on real tensors] and Note: [Measured rates] there).

Note: [Greedy choice]
Each round finds the point of the predicted peak, chooses among the tensors whose freed interval
covers it the one that frees the most bytes there, and re-evaluates, until the peak fits the
budget or nothing left lowers it. Exact about what the graphs hold (every storage, every reader),
approximate about what Inductor fuses away (its unmaterialised temporaries count): the predicted
peak is an upper bound on the graph's activations, not the allocator's peak.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from swap_pass.cost.model import compute_seconds, copy_seconds, tensor_bytes
from swap_pass.cost.probes import copy_bandwidth, flop_rate

__all__ = ["Budget", "CostModel", "SwapChoice", "choose_swaps"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """How fast the device copies and computes, for deciding whether a copy hides.

    Args:
        copy_bytes_per_s: Host link bandwidth in bytes/s; measured on the graph's device when
            ``None``. Default: ``None``.
        flops_per_s: Achieved matmul FLOP/s; measured on the graph's device, with the dtype of
            its matmuls, when ``None`` (see Note: [Throughput probe] in
            :mod:`swap_pass.cost.probes`). Default: ``None``.

    Given rates are never measured; missing ones once per device and dtype (Note: [Measured rates]).
    """

    copy_bytes_per_s: float | None = None
    flops_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("copy_bytes_per_s", "flops_per_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"swap_pass.CostModel: {name}={value!r} is invalid. "
                                 "It must be None or a number > 0.")

    def resolved(self, device: torch.device, dtype: torch.dtype | None = None) -> CostModel:
        """This model with the missing figures measured on ``device`` (once per device and dtype:
        :func:`swap_pass.cost.probes.copy_bandwidth`, :func:`swap_pass.cost.probes.flop_rate`).

        Args:
            device: The graph's device.
            dtype: The dtype of the graph's matmuls. Default: ``None`` (the FLOP rate stays
                unmeasured until :func:`choose_swaps` reads the dtype from the graph).
        """
        copy = self.copy_bytes_per_s or copy_bandwidth(device)
        flops = self.flops_per_s
        if flops is None and dtype is not None:
            flops = flop_rate(device, dtype)
        return CostModel(copy, flops)


def matmul_dtype(gm: fx.GraphModule) -> torch.dtype | None:
    """The dtype of ``gm``'s first matmul-class node (the FLOP rate's), or None without one."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if _flops(n) and isinstance(val, torch.Tensor):
            return val.dtype
    return None


@dataclasses.dataclass(frozen=True)
class Budget:
    """``memory_budget`` of ``make_swap_backend``: bytes, or a fraction of the unswapped peak."""

    value: int | float

    def __post_init__(self) -> None:
        v = self.value
        ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (
            isinstance(v, float) and 0.0 < v <= 1.0)
        if not ok:
            raise ValueError(
                f"swap_pass.make_swap_backend: memory_budget={v!r} is invalid. It must be an int "
                "number of bytes >= 0 or a float fraction of the unswapped peak in (0, 1].")

    def bytes_for(self, peak: int) -> int:
        return self.value if isinstance(self.value, int) else int(self.value * peak)


@dataclasses.dataclass(frozen=True)
class SwapChoice:
    """One saved tensor chosen for swapping, with where its copies start and end.

    ``wait_after``: the forward node after which the D2H copy is waited for (and the tensor
    freed); ``prefetch_before``: the backward node before which its H2D copy starts.
    """

    node: fx.Node
    nbytes: int
    wait_after: fx.Node
    prefetch_before: fx.Node


# --- the timeline -----------------------------------------------------------------------------


def _val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


# Note: [Planning with symbolic sizes]
# Under dynamic shapes (``dynamic=True``, or the automatic dynamic recompile after a second
# sequence length) sizes are SymInts; reading them as ints would add guards and specialize the
# graph, so the plan uses their size hints (the sizes the graph was compiled for). That plan serves
# every later size: bytes and FLOPs grow together with the sequence length, so which copies hide
# barely changes. A size without a hint (data-dependent, unbacked) cannot be planned: its tensor
# is no candidate, and is counted under ``swap_stats().skipped_bytes["dynamic_shape"]``.


def size_hint(size: object) -> int | None:
    """``size`` as an int: itself, or a SymInt's hint (``None`` for an unbacked one)."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None)
    if hint is not None:
        return int(hint)
    try:
        return int(node.shape_env.size_hint(node.expr))
    except Exception:  # unbacked: no hint exists
        return None


def hinted_shape(val: torch.Tensor) -> list[int] | None:
    """``val``'s shape with hints for symbolic sizes (Note: [Planning with symbolic sizes])."""
    shape = [size_hint(d) for d in val.shape]
    return None if any(d is None for d in shape) else shape


def _nbytes(val: torch.Tensor) -> int | None:
    shape = hinted_shape(val)
    if shape is None:
        return None
    return tensor_bytes(shape, val.dtype)


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _base(node: fx.Node, bases: dict[fx.Node, fx.Node]) -> fx.Node:
    if _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        return bases.get(node.args[0], node.args[0])
    return node


def _flops(node: fx.Node) -> int:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or packet not in flop_registry:
        return 0
    args, kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda n: _hinted(n.meta.get("val")),
                                                     (node.args, node.kwargs))
    try:
        out = torch.utils._pytree.tree_map(_hinted, node.meta.get("val"))
        return int(flop_registry[packet](*args, out_val=out, **kwargs))
    except Exception:  # symbolic sizes or an exotic overload: no compute counted (conservative)
        return 0


def _hinted(val: object) -> object:
    """A meta tensor with ``val``'s hinted shape: FLOP formulas then give ints, add no guards."""
    if not isinstance(val, torch.Tensor):
        return size_hint(val) if isinstance(val, torch.SymInt) else val
    shape = hinted_shape(val)
    return val if shape is None else torch.empty(shape, dtype=val.dtype, device="meta")


@dataclasses.dataclass
class _Timeline:
    """Forward then backward nodes on one axis, with compute time and storage intervals."""

    nodes: list[fx.Node]
    index: dict[fx.Node, int]
    clock: list[float]  # seconds of compute finished after each node
    storages: dict[fx.Node, int]  # base node -> bytes
    holders: dict[fx.Node, list[tuple[fx.Node, int, int]]]  # base -> (node, first, last)
    num_fw: int


def _timeline(fw: fx.GraphModule, bw: fx.GraphModule, cost: CostModel) -> _Timeline:
    nodes = [*fw.graph.nodes, *bw.graph.nodes]
    index = {n: i for i, n in enumerate(nodes)}
    clock, total = [], 0.0
    for n in nodes:
        total += compute_seconds(_flops(n), cost.flops_per_s)
        clock.append(total)
    bw_ph = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    bases: dict[fx.Node, fx.Node] = {}
    storages, holders = {}, {}
    for n in nodes:
        val = _val(n)
        if n.op in ("placeholder", "output") or val is None:
            continue
        base = bases[n] = _base(n, bases)
        if base is n:
            nbytes = _nbytes(val)
            if nbytes is None or base.op == "placeholder":
                continue
            storages[n] = nbytes
        if base in storages:
            holders.setdefault(base, []).append((n, index[n], _last_use(n, index, bw_ph)))
    return _Timeline(nodes, index, clock, storages, holders, len(fw.graph.nodes))


def _last_use(node: fx.Node, index: dict[fx.Node, int], bw_ph: dict[str, fx.Node]) -> int:
    users = [u for u in node.users if u.op != "output"]
    if any(u.op == "output" for u in node.users) and node.name in bw_ph:
        users += list(bw_ph[node.name].users)  # saved for backward: lives to its last reader there
    return max((index[u] for u in users), default=index[node])


def _profile(tl: _Timeline, chosen: dict[fx.Node, SwapChoice]) -> list[int]:
    """Live bytes at each point of the timeline."""
    diff = [0] * (len(tl.nodes) + 1)
    for base, nbytes in tl.storages.items():
        for lo, hi in _storage_intervals(tl, base, chosen):
            diff[lo] += nbytes
            diff[hi + 1] -= nbytes
    live, out = 0, []
    for d in diff[:-1]:
        live += d
        out.append(live)
    return out


def _holder_intervals(tl: _Timeline, node: fx.Node, first: int, last: int,
                      chosen: dict[fx.Node, SwapChoice]) -> list[tuple[int, int]]:
    c = chosen.get(node)
    if c is None:
        return [(first, last)]
    return [(first, tl.index[c.wait_after]), (tl.index[c.prefetch_before], last)]


def _storage_intervals(tl: _Timeline, base: fx.Node, chosen) -> list[tuple[int, int]]:
    spans = sorted(s for n, lo, hi in tl.holders[base]
                   for s in _holder_intervals(tl, n, lo, hi, chosen))
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


# --- candidates -------------------------------------------------------------------------------


def _placement(tl: _Timeline, node: fx.Node, nbytes: int, cost: CostModel,
               bw: fx.GraphModule) -> SwapChoice | None:
    """Where the copies of saved ``node`` start and end so they hide; ``None`` when they cannot."""
    copy = copy_seconds(nbytes, cost.copy_bytes_per_s)
    start, fw_end = tl.index[node], tl.num_fw - 1  # fw_end: the forward's output node
    readers = [tl.index[u] for u in node.users if u.op != "output"]
    hidden = next((i for i in range(start, fw_end) if tl.clock[i] - tl.clock[start] >= copy), None)
    if hidden is None:
        return None
    wait = max([hidden, *readers])
    if wait >= fw_end:
        return None
    ph = next((p for p in bw.graph.find_nodes(op="placeholder") if p.name == node.name), None)
    if ph is None or not ph.users:
        return None
    first = min(tl.index[u] for u in ph.users)
    pre = next((i for i in range(first - 1, fw_end, -1)
                if tl.clock[first - 1] - tl.clock[i] >= copy), None)
    if pre is None or tl.nodes[pre].op == "placeholder":
        return None
    return SwapChoice(node, nbytes, tl.nodes[wait], tl.nodes[pre])


def choose_swaps(fw: fx.GraphModule, bw: fx.GraphModule, candidates: list[tuple[fx.Node, int]],
                 budget: Budget, cost: CostModel) -> tuple[list[SwapChoice], int, int]:
    """Pick saved tensors to swap, largest benefit at the predicted peak first.

    Args:
        fw, bw: The partitioned forward and backward graphs (not yet rewritten).
        candidates: Saved tensors that may be swapped, with their bytes.
        budget: The target peak.
        cost: Resolved bandwidth and FLOP rate.

    Returns:
        The choices in forward order, the predicted peak without swap and with the choices.
    """
    cost = _with_flops(fw, bw, candidates, cost)
    tl = _timeline(fw, bw, cost)
    options = {n: c for n, nb in candidates if (c := _placement(tl, n, nb, cost, bw)) is not None}
    chosen: dict[fx.Node, SwapChoice] = {}
    profile = _profile(tl, chosen)
    before, target = max(profile, default=0), budget.bytes_for(max(profile, default=0))
    while options and max(profile) > target:
        at = max(range(len(profile)), key=profile.__getitem__)
        gains = {n: _gain(tl, c, chosen, at) for n, c in options.items()}
        best = max(gains, key=lambda n: (gains[n], options[n].nbytes), default=None)
        if best is None or gains[best] <= 0:
            break
        chosen[best] = options.pop(best)
        profile = _profile(tl, chosen)
    order = sorted(chosen.values(), key=lambda c: tl.index[c.node])
    return order, before, max(profile, default=0)


def _with_flops(fw: fx.GraphModule, bw: fx.GraphModule,
                candidates: list[tuple[fx.Node, int]], cost: CostModel) -> CostModel:
    """``cost`` with its FLOP rate measured, if missing, on the candidates' device in the
    dtype of the graphs' matmuls (see Note: [Throughput probe] in :mod:`swap_pass.cost.probes`)."""
    if cost.flops_per_s is not None:
        return cost
    vals = (n.meta.get("val") for n, _ in candidates)
    device = next((v.device for v in vals if isinstance(v, torch.Tensor)), torch.device("cpu"))
    dtype = matmul_dtype(fw) or matmul_dtype(bw) or torch.float32
    return CostModel(cost.copy_bytes_per_s, flop_rate(device, dtype))


def _gain(tl: _Timeline, choice: SwapChoice, chosen: dict, at: int) -> int:
    """Bytes that choosing ``choice`` frees at timeline point ``at``."""
    base = next((b for b, hs in tl.holders.items() if any(h[0] is choice.node for h in hs)), None)
    if base is None:
        return 0
    covers = lambda spans: any(lo <= at <= hi for lo, hi in spans)  # noqa: E731
    if not covers(_storage_intervals(tl, base, chosen)):
        return 0
    if covers(_storage_intervals(tl, base, {**chosen, choice.node: choice})):
        return 0
    return tl.storages[base]
