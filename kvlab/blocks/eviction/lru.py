"""LRU, kvlab's default policy: never-cached blocks first, then cached ones least recently used first."""

import heapq
from collections import deque
from itertools import chain, compress, repeat, starmap
from operator import itemgetter, not_
from typing import Iterator

from kvlab.blocks.eviction.base import EvictionPolicy
from kvlab.errors import OutOfBlocksError


class FifoSet:
    """Blocks in the order they were added, oldest first, with O(1) removal from anywhere.

    A removal only counts a *stale* entry for that block: its entries in the queue that pop must skip. A
    removed block's stale entries are always older than the entry of its next ``add``, so skipping the
    first ones pop meets is exact. Adding and popping a batch run in C; Python looks at an entry only if
    its block has stale ones.
    """

    def __init__(self) -> None:
        self._queue: deque[int] = deque()
        # Per block, in lists grown to the largest block seen: whether it is a member, and its stale entries
        # ahead in the queue. Lists, not a set and a dict: every block enters and leaves once per reuse, and
        # hashing it into tables several times these lists' size costs a replay 8% more cache misses.
        self._is_member: list[bool] = []
        self._stale: list[int] = []
        self._count = 0        # members
        self._num_stale = 0    # stale entries in the queue

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block: int) -> bool:
        return 0 <= block < len(self._is_member) and self._is_member[block]

    def add_many(self, blocks: list[int]) -> None:
        """Add blocks that are not members (the pool never frees a free block)."""
        if not blocks:
            return
        is_member = self._is_member
        if max(blocks) >= len(is_member):
            grow = max(blocks) + 1 - len(is_member)
            is_member.extend([False] * grow)
            self._stale.extend([0] * grow)
        for block in blocks:
            is_member[block] = True
        self._count += len(blocks)
        self._queue.extend(blocks)

    def remove(self, block: int) -> None:
        if block not in self:
            raise KeyError(block)
        self._is_member[block] = False
        self._count -= 1
        self._stale[block] += 1
        self._num_stale += 1

    def pop_many(self, count: int) -> list[int]:
        """The ``count`` oldest members (the caller checked there are enough)."""
        popleft, taken = self._queue.popleft, []
        while len(taken) < count:  # again only if stale entries were skipped
            batch = list(starmap(popleft, repeat((), count - len(taken))))  # the loop in C
            taken += self._without_stale(batch) if self._num_stale else batch
        is_member = self._is_member
        for block in taken:
            is_member[block] = False
        self._count -= len(taken)
        return taken

    def _without_stale(self, batch: list[int]) -> list[int]:
        """``batch`` (entries just popped, oldest first) less its stale entries, which stop counting. Python
        looks only at the entries of blocks that have stale ones (a few: prefix hits revive a few free blocks);
        the rest is done in C."""
        stale, keep = self._stale, [True] * len(batch)
        ahead = itemgetter(*batch)(stale) if len(batch) > 1 else (stale[batch[0]],)
        for i in compress(range(len(batch)), ahead):
            block = batch[i]
            if stale[block]:  # 0 once the batch skipped all of them
                keep[i] = False
                stale[block] -= 1
                self._num_stale -= 1
        return list(compress(batch, keep))

    def __iter__(self) -> Iterator[int]:
        skip = list(self._stale)
        for block in self._queue:
            if skip[block]:
                skip[block] -= 1
                continue
            yield block


class LRUPolicy(EvictionPolicy):
    """Never-cached blocks first (vLLM V0's order), then cached ones least recently used first.

    "Recently used" means "recently freed" (vLLM V1's free queue): a block is in use, so not evictable,
    until its last reference goes, and a sequence frees its blocks tail first, so among blocks freed
    together the chain's tail is reused first and the shared heads of prefixes live longest.

    An engine that reports accesses (``BlockManager.access_all_blocks_in_seq(seq, now)``, vLLM V0's
    touches) gets V0's order for the blocks it touched: they are reused after every untouched cached block
    (which counts as never accessed, like V0's default access time) and among themselves oldest ``now``
    first. Without touches the fast path below is all that runs.
    """

    def __init__(self) -> None:
        self._uncached = FifoSet()
        self._cached = FifoSet()                 # untouched, least recently freed first
        self._touched_at: dict[int, float] = {}  # block -> its latest reported access, until it is reused
        self._touched: dict[int, tuple] = {}     # free cached touched block -> its current heap key
        self._heap: list[tuple] = []             # (now, tie, block), possibly stale (lazy deletion)
        self._tie = 0                            # keeps release order among equal access times

    def add(self, block_id: int, cached: bool) -> None:
        if not cached:
            self._uncached.add_many((block_id,))
        elif block_id in self._touched_at:
            self._push(block_id)
        else:
            self._cached.add_many((block_id,))

    def add_many(self, block_ids: list[int], cached: list[bool]) -> None:
        if self._touched_at:
            for block_id, is_cached in zip(block_ids, cached):
                self.add(block_id, is_cached)
            return
        self._uncached.add_many(list(compress(block_ids, map(not_, cached))))
        self._cached.add_many(list(compress(block_ids, cached)))

    def remove(self, block_id: int) -> None:
        if block_id in self._cached:
            self._cached.remove(block_id)
        elif self._touched.pop(block_id, None) is None:
            self._uncached.remove(block_id)

    def pop(self) -> int:
        return self.pop_many(1)[0]

    def pop_many(self, count: int) -> list[int]:
        if count > len(self):
            raise OutOfBlocksError(f"{count} blocks wanted, {len(self)} free")
        from_uncached = min(count, len(self._uncached))
        taken = self._uncached.pop_many(from_uncached)
        if count > from_uncached:
            taken += self._cached.pop_many(min(count - from_uncached, len(self._cached)))
        while len(taken) < count:
            now, tie, block = heapq.heappop(self._heap)
            if self._touched.get(block) == (now, tie):
                del self._touched[block]
                taken.append(block)
        if self._touched_at:
            for block in taken:  # new content: its old accesses no longer count
                self._touched_at.pop(block, None)
        return taken

    def on_access(self, block_id: int, now: float) -> None:
        refile = block_id in self._cached or block_id in self._touched
        if refile:
            self.remove(block_id)
        self._touched_at[block_id] = max(now, self._touched_at.get(block_id, now))
        if refile:
            self.add(block_id, True)

    def _push(self, block_id: int) -> None:
        key = self._touched[block_id] = (self._touched_at[block_id], self._tie)
        self._tie += 1
        if len(self._heap) > 2 * len(self._touched) + 1024:  # stale entries dominate: rebuild, O(n) amortised
            self._heap = [(*k, block) for block, k in self._touched.items()]
            heapq.heapify(self._heap)
        else:
            heapq.heappush(self._heap, (*key, block_id))

    def filed_as_cached(self, block_id: int) -> bool:
        return block_id in self._cached or block_id in self._touched

    def __iter__(self) -> Iterator[int]:
        touched = (block for _, block in sorted((key, block) for block, key in self._touched.items()))
        return chain(self._uncached, self._cached, touched)

    def __len__(self) -> int:
        return len(self._uncached) + len(self._cached) + len(self._touched)
