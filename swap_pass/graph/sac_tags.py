"""Selective-checkpoint offload tags under ``swap_backend``: tagged nodes are saved and swapped.

Joint graph (one checkpointed region, a policy tagging ``addmm`` ``MUST_CPU_OFFLOAD``)::

    addmm = aten.addmm(b, x, w)   # meta["recompute"] = MUST_CPU_OFFLOAD, meta["ac_graph_id"] = 4
                      |  take_offload_tags: recorded, re-tagged MUST_SAVE
                      v  (the partitioner saves it instead of recomputing it)
    forward graph:  addmm saved  ->  h = swap_pass.swap_out(addmm) ... swap_pass.wait(h, addmm)
    backward graph: swap_pass.prefetch(h, ...) one layer ahead ... swap_pass.wait before its reader

Note: [Offload tags in compiled graphs]
    torch's selective checkpointing under ``torch.compile`` writes each op's policy into the
    joint graph (``node.meta["recompute"]``, the region in ``node.meta["ac_graph_id"]``); its
    partitioner knows only ``*_SAVE`` and ``*_RECOMPUTE``, leaving ``*_CPU_OFFLOAD`` to the
    min-cut. So :func:`take_offload_tags` records the offload-tagged nodes and re-tags them
    ``MUST_SAVE`` before partitioning; after it, :func:`plan_offloads` swaps each one the forward
    saves (beside the layer inputs or the budget choice), its host-to-device copy started one
    layer ahead (at the top of backward when it is in no layer, or in the graph's last). One the
    forward cannot swap (also a user-visible output, a graph input, or not dense) is an error
    naming its op under ``MUST_CPU_OFFLOAD``; under ``PREFER_CPU_OFFLOAD`` it stays saved on the
    device, counted (``SkipReason.OFFLOAD_FALLBACK``). One backward does not read is not saved at
    all: nothing to swap, nothing recomputed.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import fx

from swap_pass.config import SwapConfig
from swap_pass.graph.aot_pass import _Planned, _saved, _swappable_bytes
from swap_pass.graph.boundaries import LayerFilter, find_layers
from swap_pass.runtime.stats import SkipReason, record_skip

__all__ = ["plan_offloads", "take_offload_tags"]

log = logging.getLogger(__name__)
_API = "swap_backend"


def _offload_policies() -> tuple[Any, ...]:
    from torch.utils.checkpoint import CheckpointPolicy

    return tuple(getattr(CheckpointPolicy, name) for name in
                 ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD") if hasattr(CheckpointPolicy, name))


def take_offload_tags(joint: fx.GraphModule) -> dict[str, Any]:
    """Re-tag the joint graph's ``*_CPU_OFFLOAD`` nodes ``MUST_SAVE``; return their tags by name.

    Tuple-valued nodes keep their tag (the partitioner saves their ``getitem`` nodes, tagged too).
    """
    offload = _offload_policies()
    if not offload:
        return {}
    from torch.utils.checkpoint import CheckpointPolicy

    tags = {}
    for node in joint.graph.nodes:
        policy = node.meta.get("recompute")
        if policy in offload and not isinstance(node.meta.get("val"), (tuple, list)):
            tags[node.name] = policy
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return tags


def _op_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else node.name


def _refuse(node: fx.Node, policy: Any, why: str) -> None:
    """A saved tagged node that cannot be swapped: an error under ``MUST_CPU_OFFLOAD``."""
    if policy.name.startswith("MUST"):
        raise RuntimeError(
            f"swap_pass.{_API}: {node.name} ({_op_name(node)}) is tagged MUST_CPU_OFFLOAD but "
            f"cannot be swapped: it {why}. A MUST_CPU_OFFLOAD node must be saved for backward "
            "only, with a dense layout; tag it PREFER_CPU_OFFLOAD to keep it saved on the device "
            "when it cannot move, or MUST_SAVE."
        )
    record_skip(SkipReason.OFFLOAD_FALLBACK, _nbytes(node), where=f"{_API} ({_op_name(node)})",
                detail=f"It {why}.")


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    try:
        return int(val.numel() * val.element_size())
    except (AttributeError, TypeError):  # no tensor value, or a symbolic size
        return 0


def _too_small(node: fx.Node, config: SwapConfig) -> bool:
    return 0 < _nbytes(node) < config.min_swap_bytes


def _why_not(node: fx.Node, user_outputs: set) -> str:
    if node in user_outputs:
        return "is also an output of the compiled region"
    return "is a graph input, empty, or has no dense layout"


def _next_layers(fw: fx.GraphModule, layer_filter: LayerFilter) -> dict[fx.Node, tuple[str, Any]]:
    """For each node of a layer: that layer's name, and the next layer's (None for the last)."""
    layers = find_layers(fw, layer_filter, api=_API, strict=False)
    owner = {}
    names = [layer.boundary.fqn for layer in layers]
    for idx, layer in enumerate(layers):
        for node in layer.members:
            owner[node] = (names[idx], names[idx + 1] if idx + 1 < len(names) else None)
    return owner


def plan_offloads(fw: fx.GraphModule, num_fwd_outputs: int, tags: dict[str, Any], *,
                  layer_filter: LayerFilter = None, config: SwapConfig | None = None,
                  exclude: set[fx.Node] | frozenset = frozenset()) -> list[_Planned]:
    """The saved forward nodes tagged ``*_CPU_OFFLOAD`` to swap (Note: [Offload tags in compiled
    graphs]), in forward order, less ``exclude`` (already planned).

    Raises:
        RuntimeError: a ``MUST_CPU_OFFLOAD`` node is saved but cannot be swapped.
    """
    if not tags:
        return []
    config = config or SwapConfig()
    user_outputs, saved = _saved(fw, num_fwd_outputs)
    layers = _next_layers(fw, layer_filter)
    planned = []
    for node in fw.graph.nodes:
        policy = tags.get(node.name)
        if policy is None or node in exclude:
            continue
        if node not in saved:
            log.debug("swap_pass.%s: %s is tagged %s but backward does not read it",
                      _API, node.name, policy.name)
            continue
        nbytes = _swappable_bytes(node, saved, user_outputs, config)
        if nbytes is None and _too_small(node, config):  # the user's own threshold
            record_skip(SkipReason.TOO_SMALL, _nbytes(node), where=_API)
            continue
        if nbytes is None:
            _refuse(node, policy, _why_not(node, user_outputs))
            continue
        layer, nxt = layers.get(node, ("", None))
        planned.append(_Planned(node, layer, nbytes, [], next_layer=nxt))
    return planned
