"""Eviction policies: which free block to reuse first (LRU, FIFO, LFU, or your own ``EvictionPolicy``).
"""

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
import heapq
from itertools import chain, compress, repeat, starmap
from operator import itemgetter, not_
from typing import Iterator

from kvlab.errors import InvalidArgumentError, OutOfBlocksError


# ==== the policy interface ============================================================================================
# The eviction-policy interface: which free block the pool reuses next.
#
# A block whose reference count drops to 0 is *free*. If it still holds a registered prefix (its hash is in
# the prefix cache) it stays *cached*: a later request can hit it and take it back, until the pool reuses it
# for new content, which evicts that prefix. The policy owns the set of free blocks and decides the reuse
# order; the pool tells it about every change. Every call must cost O(1) (or O(log n)) in the pool size:
# never scan the pool, never ``list.remove``.
#
# To add a policy, subclass ``EvictionPolicy`` (not ``LRUPolicy``, whose fast batch methods bypass ``pop``
# and ``add``), implement the five abstract methods and register the class in ``kvlab.blocks.eviction.POLICIES``
# (then ``BlockManager(..., eviction="name")`` finds it). A policy that raises never corrupts the manager:
# the operation is undone (see ``kvlab.blocks.block_pool``).

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
        """``BlockManager.touch`` says block ``block_id`` (in use) was used at time
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

    def remove_many(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.remove(block_id)


# ==== LRU =============================================================================================================
# LRU, kvlab's default policy: never-cached blocks first, then cached ones least recently used first.

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
        self.num_members = 0
        self._num_stale = 0    # stale entries in the queue

    def __len__(self) -> int:
        return self.num_members

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
        self.num_members += len(blocks)
        self._queue.extend(blocks)

    def discard_many(self, blocks) -> list[int]:
        """Remove the members among ``blocks``; returns the others, in order."""
        is_member, stale, others = self._is_member, self._stale, []
        size = len(is_member)
        for block in blocks:
            if 0 <= block < size and is_member[block]:
                is_member[block] = False
                stale[block] += 1  # its entry stays in the queue: pop skips it
            else:
                others.append(block)
        removed = len(blocks) - len(others)
        self.num_members -= removed
        self._num_stale += removed
        return others

    def pop_many(self, count: int) -> list[int]:
        """The ``count`` oldest members (the caller checked there are enough)."""
        popleft, taken = self._queue.popleft, []
        while len(taken) < count:  # again only if stale entries were skipped
            batch = list(starmap(popleft, repeat((), count - len(taken))))  # the loop in C
            taken += self._without_stale(batch) if self._num_stale else batch
        is_member = self._is_member
        for block in taken:
            is_member[block] = False
        self.num_members -= len(taken)
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

    An engine that reports accesses (``BlockManager.touch(seq, now)``, vLLM V0's ``access_all_blocks_in_seq``
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
        self.remove_many((block_id,))

    def remove_many(self, block_ids) -> None:
        rest = self._cached.discard_many(block_ids)
        if rest:  # touched cached blocks, or never-cached ones
            rest = [block for block in rest if self._touched.pop(block, None) is None]
            missing = self._uncached.discard_many(rest)
            if missing:
                raise KeyError(missing[0])

    def pop(self) -> int:
        return self.pop_many(1)[0]

    def pop_many(self, count: int) -> list[int]:
        uncached, cached = self._uncached, self._cached
        if count > uncached.num_members + cached.num_members + len(self._touched):
            raise OutOfBlocksError(f"{count} blocks wanted, {len(self)} free")
        from_uncached = min(count, uncached.num_members)
        taken = uncached.pop_many(from_uncached)
        if count > from_uncached:
            taken += cached.pop_many(min(count - from_uncached, cached.num_members))
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


# ==== FIFO and LFU ====================================================================================================
# FIFO and LFU: policies that order cached free blocks by a key (age of the content, hit count).
#
# Both reuse never-cached blocks first, like LRU. They ignore ``on_access`` recency touches.

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


# ==== the registry ====================================================================================================
# Eviction policies: which free block the pool reuses next (interface in ``base.py``).

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
