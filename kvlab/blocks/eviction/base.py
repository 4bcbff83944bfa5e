"""The eviction-policy interface: which free block the pool reuses next.

A block whose reference count drops to 0 is *free*. If it still holds a registered prefix (its hash is in
the prefix cache) it stays *cached*: a later request can hit it and take it back, until the pool reuses it
for new content, which evicts that prefix. The policy owns the set of free blocks and decides the reuse
order; the pool tells it about every change. Every call must cost O(1) (or O(log n)) in the pool size:
never scan the pool, never ``list.remove``.

To add a policy, subclass ``EvictionPolicy`` (not ``LRUPolicy``, whose fast batch methods bypass ``pop``
and ``add``), implement the five abstract methods and register the class in ``kvlab.blocks.eviction.POLICIES``
(then ``BlockManager(..., eviction="name")`` finds it). A policy that raises never corrupts the manager:
the operation is undone (see ``kvlab.blocks.policy_transaction``).
"""

from abc import ABC, abstractmethod
from typing import Iterator


class EvictionPolicy(ABC):
    """The set of free blocks, in the order they will be reused."""

    @abstractmethod
    def add(self, block_id: int, cached: bool) -> None:
        """``block_id`` became free; ``cached`` says whether it still holds a hittable prefix."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """``block_id`` (free) leaves the free set without being reused: a prefix hit took it back."""

    @abstractmethod
    def pop(self) -> int:
        """Remove and return the next block to reuse (raise OutOfBlocksError when empty)."""

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """Free blocks in the order ``pop`` would return them."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of free blocks."""

    def on_hit(self, block_id: int) -> None:
        """A prefix lookup hit ``block_id`` (free or in use). Frequency-based policies count these."""

    def on_access(self, block_id: int, now: float) -> None:
        """``BlockManager.access_all_blocks_in_seq`` says block ``block_id`` (in use) was used at time
        ``now``. Recency-based policies may order by it."""

    def filed_as_cached(self, block_id: int):
        """For ``check_invariants``: whether free ``block_id`` was added as cached (None: not tracked)."""
        return None

    # Batch forms, called on the hot path (a prompt takes or frees hundreds of blocks at once). Override
    # them only to save per-call overhead; they must behave exactly like the loops below.
    def pop_many(self, count: int) -> list[int]:
        return [self.pop() for _ in range(count)]

    def add_many(self, block_ids: list[int], cached: list[bool]) -> None:
        for block_id, is_cached in zip(block_ids, cached):
            self.add(block_id, is_cached)
