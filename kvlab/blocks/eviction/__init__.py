"""Eviction policies: which free block the pool reuses next (interface in ``base.py``)."""

from kvlab.blocks.eviction.base import EvictionPolicy
from kvlab.blocks.eviction.keyed import FIFOPolicy, LFUPolicy
from kvlab.blocks.eviction.lru import LRUPolicy
from kvlab.errors import InvalidArgumentError

#: Policies by name, for ``BlockManager(eviction=name)`` and the studies' ``--policy`` option.
POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy}

#: kvlab's own policies: they never raise on a valid call, so the manager uses their batch methods directly.
BUILTIN_POLICIES = frozenset(POLICIES.values())

__all__ = ["EvictionPolicy", "LRUPolicy", "FIFOPolicy", "LFUPolicy", "POLICIES", "BUILTIN_POLICIES", "make_policy"]


def make_policy(eviction) -> EvictionPolicy:
    """A policy from a name in POLICIES, or the given instance if it is an empty EvictionPolicy."""
    if isinstance(eviction, str):
        if eviction not in POLICIES:
            raise InvalidArgumentError(f"unknown eviction policy {eviction!r}; known: {sorted(POLICIES)}")
        return POLICIES[eviction]()
    if not isinstance(eviction, EvictionPolicy) or len(eviction):
        raise InvalidArgumentError("eviction must be a policy name or an empty EvictionPolicy instance")
    return eviction
