"""FIFO and LFU: policies that order cached free blocks by a key (age of the content, hit count).

Both reuse never-cached blocks first, like LRU. They ignore ``on_access`` recency touches.
"""

import heapq
from abc import abstractmethod
from collections import OrderedDict
from itertools import chain
from typing import Iterator

from kvlab.blocks.eviction.base import EvictionPolicy
from kvlab.errors import OutOfBlocksError


class _KeyedPolicy(EvictionPolicy):
    """Never-cached blocks first, then cached ones by smallest ``_key``; subclasses define the key.

    The cached free blocks sit in a heap with lazy deletion: ``remove`` only forgets the block's current
    key, and ``pop`` skips heap entries whose key is no longer current. A key is fixed while the block is
    free (it can only change through a hit, which takes the block out first), so O(log n) per call. Keys
    are unique ints (a clock tick is part of each); a heap entry is the single int key * 2**32 + block id,
    which keeps heap comparisons cheap (block ids stay below 2**32).
    """

    def __init__(self) -> None:
        self._uncached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # free cached block -> its current key
        self._heap: list[int] = []         # key << 32 | block, possibly stale
        self._clock = 0                    # ticks on every cached add and every reuse

    @abstractmethod
    def _key(self, block_id: int) -> int:
        """Eviction priority of a block becoming free and cached: the smallest key is reused first."""

    @abstractmethod
    def _reused(self, blocks: list[int]) -> None:
        """``blocks`` left the free set to receive new content (their old prefixes, if any, are gone)."""

    def add(self, block_id: int, cached: bool) -> None:
        self.add_many([block_id], [cached])

    def add_many(self, block_ids: list[int], cached: list[bool]) -> None:
        uncached_set, cached_keys, heap, key_of = self._uncached, self._cached, self._heap, self._key
        for block_id, is_cached in zip(block_ids, cached):
            if is_cached:
                key = cached_keys[block_id] = key_of(block_id)
                heapq.heappush(heap, key << 32 | block_id)
            else:
                uncached_set[block_id] = None
        if len(heap) > 2 * len(cached_keys) + 1024:  # stale entries dominate: rebuild, O(n) amortised
            self._heap = [key << 32 | block for block, key in cached_keys.items()]
            heapq.heapify(self._heap)

    def remove(self, block_id: int) -> None:
        if self._cached.pop(block_id, None) is None:
            del self._uncached[block_id]

    def pop(self) -> int:
        return self.pop_many(1)[0]

    def pop_many(self, count: int) -> list[int]:
        if count > len(self):
            raise OutOfBlocksError(f"{count} blocks wanted, {len(self)} free")
        pop_uncached = self._uncached.popitem
        taken = [pop_uncached(False)[0] for _ in range(min(count, len(self._uncached)))]
        heap, cached_keys = self._heap, self._cached
        while len(taken) < count:
            entry = heapq.heappop(heap)
            block = entry & 0xFFFFFFFF
            if cached_keys.get(block) == entry >> 32:
                del cached_keys[block]
                taken.append(block)
        self._reused(taken)
        return taken

    def filed_as_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    def __iter__(self) -> Iterator[int]:
        # Sorting is O(n log n), but iteration is for inspection and tests, never on the hot path.
        return chain(self._uncached, (b for _, b in sorted((k, b) for b, k in self._cached.items())))

    def __len__(self) -> int:
        return len(self._uncached) + len(self._cached)


class FIFOPolicy(_KeyedPolicy):
    """Evict the cached block whose content is oldest (filled first), however often it was hit since.

    A block's content is born when the pool pops it for new content, so a prompt's head block is older
    than its tail: FIFO evicts a chain head first, which leaves the chain's later blocks cached but
    unreachable (a prefix lookup stops at the first miss) until they age out in turn.
    """

    def __init__(self) -> None:
        super().__init__()
        self._born: dict[int, int] = {}

    def _key(self, block_id: int) -> int:
        return self._born.get(block_id, 0)

    def _reused(self, blocks: list[int]) -> None:
        self._born.update(zip(blocks, range(self._clock + 1, self._clock + 1 + len(blocks))))
        self._clock += len(blocks)


class LFUPolicy(_KeyedPolicy):
    """Evict the cached block with the fewest prefix hits since it was filled; ties go to the least
    recently freed (so among blocks freed together, the chain's tail, as in LRU).

    A head block is hit at least as often as any block after it in its chain, so LFU keeps shared
    prefixes. Counts never decay: a block that was popular long ago stays hard to evict (classic LFU).
    """

    def __init__(self) -> None:
        super().__init__()
        self._hits: dict[int, int] = {}

    def _key(self, block_id: int) -> int:
        self._clock += 1
        return (self._hits.get(block_id, 0) << 40) + self._clock  # fewest hits, then least recently freed

    def on_hit(self, block_id: int) -> None:
        self._hits[block_id] = self._hits.get(block_id, 0) + 1

    def _reused(self, blocks: list[int]) -> None:
        hits = self._hits
        for block in blocks:
            hits.pop(block, None)

