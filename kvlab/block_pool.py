"""The GPU pool: fixed-size blocks with reference counts, and the prefix cache over them.

Per-block state lives in parallel lists indexed by block id (cheaper than an object per block, and every
operation below is O(1) in the pool size). A block is in exactly one of two states:
    used: ref_count > 0, referenced by that many block-table entries;
    free: ref_count == 0, owned by the eviction policy, which decides the reuse order.
A *sealed* block is full and immutable. It records a content id: a unique number for "these tokens after
that exact prefix". A block is *cached* (hittable) when the hash map points at it; a free cached block is
"warm": a hit takes it back, reusing it for new content evicts it.

Why content ids: a lookup shares block c for logical block i only if c holds the same tokens AND c's parent
(the block it was computed after) holds exactly the content the lookup matched for block i - 1. Comparing
content ids (not block ids, which are reused) makes that check O(1) and immune to hash collisions at this
block or any earlier one: a weak hash only costs hits, never correctness.
"""

import enum
from typing import NamedTuple, Optional

from kvlab.eviction import EvictionPolicy

NO_CONTENT = -1  # block holds nothing sealed
ROOT = 0         # the "parent content" of a sequence's first block
BROKEN = -2      # chain passes through a block that was never stored (sliding window): never hittable


class AllocStatus(enum.Enum):
    OK = "ok"        # fits now
    LATER = "later"  # fits once other sequences free blocks
    NEVER = "never"  # can never fit in this pool


class Event(NamedTuple):
    """One step of the manager's work, recorded when ``record_events=True`` (for timelines and teaching)."""
    kind: str
    seq_id: Optional[int] = None
    block_id: Optional[int] = None
    other: Optional[int] = None


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy, first_block: int, events: Optional[list]):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash: list[Optional[int]] = [None] * num_blocks
        self.content = [NO_CONTENT] * num_blocks
        self.parent_content = [NO_CONTENT] * num_blocks
        self.tokens: list[Optional[bytes]] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> the one registered block with that hash
        self.registered = [False] * num_blocks  # registered[b] == (cached.get(hash[b]) == b), kept for speed
        self.policy = policy
        # Only frequency-based policies listen to hits; skipping the no-op call keeps hits cheap for the rest.
        self.hit_listener = policy.on_hit if type(policy).on_hit is not EvictionPolicy.on_hit else None
        self.first_block = first_block    # blocks below it are reserved (the sliding window's null block)
        self.events = events
        self.evictions = 0
        self._next_content = ROOT + 1
        for block in range(first_block, num_blocks):
            policy.add(block, False)

    @property
    def num_free(self) -> int:
        return len(self.policy)

    def is_cached(self, block: int) -> bool:
        return self.registered[block]

    def lookup(self, hashes: list[int], contents: list[bytes], limit: int) -> list[int]:
        """The cached blocks matching the first full blocks of a prompt, in order, stopping at the first miss
        (at most ``limit``). Pure: changes nothing."""
        hits: list[int] = []
        parent = ROOT
        cached, tokens, parent_content = self.cached, self.tokens, self.parent_content
        for i in range(min(limit, len(hashes))):
            block = cached.get(hashes[i])
            if block is None or parent_content[block] != parent or tokens[block] != contents[i]:
                break
            hits.append(block)
            parent = self.content[block]
        return hits

    def take(self, count: int) -> list[int]:
        """``count`` free blocks for new content (ref count 1 each), evicting the prefixes they cached.
        The caller checked that enough blocks are free."""
        ref, hashes, registered, events = self.ref, self.hash, self.registered, self.events
        taken = self.policy.pop_many(count)
        evicted = 0
        for block in taken:
            h = hashes[block]
            if h is not None:
                # Clearing the hash is enough to make the old content unreachable: content ids and token
                # bytes are only ever read for blocks the hash map points at, and seal() overwrites them.
                hashes[block] = None
                if registered[block]:
                    registered[block] = False
                    del self.cached[h]
                    evicted += 1
                    if events is not None:
                        events.append(Event("evict", block_id=block))
            ref[block] = 1
        self.evictions += evicted
        return taken

    def acquire(self, blocks) -> None:
        """One more reference to each block (prefix hits, a fork), taking back those that were free."""
        ref, remove = self.ref, self.policy.remove
        for block in blocks:
            if not ref[block]:
                remove(block)
            ref[block] += 1

    def release(self, blocks) -> list[int]:
        """Drop one reference to each block, in order; returns the blocks that became free (they stay
        cached if they were)."""
        ref, registered = self.ref, self.registered
        freed = []
        for block in blocks:
            count = ref[block] = ref[block] - 1
            if not count:
                freed.append(block)
        self.policy.add_many(freed, [registered[block] for block in freed])
        if self.events is not None:
            self.events.extend(Event("release", block_id=block) for block in freed)
        return freed

    def seal(self, blocks, hashes, contents, parent: int) -> int:
        """Record that each of ``blocks`` is full with ``contents[i]`` (hash ``hashes[i]``), chained after the
        prefix whose content id is ``parent``, and register each in the prefix cache unless another block
        already holds its hash (then only the first stays hittable). Returns the last block's content id,
        the next block's ``parent``."""
        block_hash, cached, events = self.hash, self.cached, self.events
        if parent == BROKEN:
            for block, h in zip(blocks, hashes):
                block_hash[block] = h
            return BROKEN
        content_id, parent_content, tokens = self.content, self.parent_content, self.tokens
        registered = self.registered
        cid = self._next_content
        for block, h, content in zip(blocks, hashes, contents):
            block_hash[block] = h
            twin = cached.setdefault(h, block)
            if twin == block:
                registered[block] = True
            elif parent_content[twin] == parent and tokens[twin] == content:
                # The same prefix is already cached in another block: this one is an unregistered duplicate
                # with the same content id, so blocks sealed after it still chain to the cached prefix.
                content_id[block], parent_content[block], tokens[block] = content_id[twin], parent, content
                parent = content_id[twin]
                continue
            content_id[block], parent_content[block], tokens[block] = cid, parent, content
            parent = cid
            cid += 1
            if events is not None:
                events.append(Event("seal", block_id=block))
        self._next_content = cid
        return parent

    def drop_all_hashes(self) -> None:
        """Forget every prefix (only valid when every block is free): all blocks become never-cached."""
        free = list(self.policy)
        for block in free:
            self.policy.remove(block)
            self.hash[block] = self.tokens[block] = None
            self.content[block] = self.parent_content[block] = NO_CONTENT
        for block in free:
            self.policy.add(block, False)
        self.cached.clear()
        self.registered = [False] * self.num_blocks
