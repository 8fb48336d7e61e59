"""SmartSwap's plan cache: one plan per operator sequence seen, least recently used out first.

A plan is keyed by the lightweight signature of the sequence it was made from. A step whose
signature is not a key still finds a plan when its key sequence is within the signature
threshold of a cached plan's (fuzzy match: the nearest one; the signature is remembered as an
alias of that plan). A stable micro-batch's follower asks :meth:`PlanCache.plans` for
candidates when its saved tensors stop matching the plan in force (Note: [Choosing a cached
plan mid-step] in follower.py).
"""

from __future__ import annotations

import collections

from swap_pass.smart.policy import SwapPolicy
from swap_pass.smart.profiler import sequence_distance

__all__ = ["PlanCache"]


class PlanCache:
    """Plans by signature, at most ``size`` of them, least recently used evicted first.

    Args:
        size: Most plans kept (``>= 1``).
        threshold: Largest key-sequence distance (0..1) at which a plan serves another sequence.

    Attributes:
        hits: Micro-batches that switched to a cached plan of an earlier shape and ran it.
        misses: Micro-batches whose sequence had no plan within the threshold (a plan was made
            from their profile).
        evictions: Plans dropped to keep the bound.
        derived: Micro-batches that ran a plan made for a larger shape of the same structure.
    """

    def __init__(self, size: int, threshold: float) -> None:
        self.size = size
        self.threshold = threshold
        self._plans: collections.OrderedDict[int, SwapPolicy] = collections.OrderedDict()
        self._aliases: dict[int, tuple[int, float]] = {}  # signature -> (plan signature, distance)
        self.hits = self.misses = self.evictions = self.derived = 0

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> list[SwapPolicy]:
        """The cached plans, most recently used first."""
        return list(reversed(self._plans.values()))

    def find(self, signature: int, keys: list[int]) -> tuple[SwapPolicy, float] | None:
        """The plan for ``keys`` (exact signature, else the nearest within the threshold) and
        its distance, or None. A found plan becomes the most recently used."""
        found = self._lookup(signature, keys)
        if found is not None:
            self._plans.move_to_end(found[0].signature)
        return found

    def _lookup(self, signature: int, keys: list[int]) -> tuple[SwapPolicy, float] | None:
        if signature in self._plans:
            return self._plans[signature], 0.0
        alias = self._aliases.get(signature)
        if alias is not None and alias[0] in self._plans:
            return self._plans[alias[0]], alias[1]
        near = [(sequence_distance(keys, p.keys), p) for p in self._plans.values()]
        near = [(d, p) for d, p in near if d <= self.threshold]
        if not near:
            return None
        distance, plan = min(near, key=lambda dp: dp[0])
        self._aliases[signature] = (plan.signature, distance)
        return plan, distance

    def put(self, plan: SwapPolicy) -> None:
        """Add ``plan`` as the most recently used, evicting the least recently used past
        ``size``."""
        self._plans[plan.signature] = plan
        self._plans.move_to_end(plan.signature)
        while len(self._plans) > self.size:
            gone, _ = self._plans.popitem(last=False)
            self._aliases = {s: a for s, a in self._aliases.items() if a[0] != gone}
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        """``{"plans", "hits", "misses", "evictions", "derived"}``."""
        return {"plans": len(self), "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "derived": self.derived}
