"""The GPU pool: fixed-size blocks with reference counts, and the prefix cache over them.

Per-block state lives in parallel lists indexed by block id (cheaper than an object per block, and every
operation below is O(1) in the pool size). A block is in exactly one of two states:
    used: ref_count > 0, referenced by that many block-table entries;
    free: ref_count == 0, owned by the eviction policy, which decides the reuse order.
A *sealed* block is full and immutable. It records a content id: a unique number for "these tokens (and
keys: a tenant's salt, an adapter, an image; see ``kvlab.blocks.block_keys``) after that exact prefix". A
block is *cached* (hittable) when the hash map points at it; a free cached block is "warm": a hit takes it
back, reusing it for new content evicts it.

Why content ids: a lookup shares block c for logical block i only if c holds the same bytes (its tokens,
then its keys) AND c's parent (the block it was computed after) holds exactly the content the lookup matched
for block i - 1. Comparing content ids (not block ids, which are reused) makes that check O(1) and immune to
hash collisions at this block or any earlier one: a weak hash only costs hits, never correctness.

Changing a block's state takes two calls: the policy side first, inside ``transaction()`` (user code that
may fail and is undone), then the bookkeeping side (``fill``, ``claim``, ``drop``), which cannot fail.
"""

from collections import Counter
from operator import itemgetter
from typing import Optional

from kvlab.blocks.event_sink import EventSink
from kvlab.blocks.eviction import EvictionPolicy
from kvlab.blocks.policy_transaction import policy_transaction
from kvlab.errors import InvariantViolation

NO_CONTENT = -1  # block holds nothing sealed
ROOT = 0         # the "parent content" of a sequence's first block


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy, first_block: int, sink: Optional[EventSink]):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        # A sealed block's hash, content id, its parent's content id and bytes (its tokens, then its keys'
        # encoding). Parallel lists, not a tuple per block: a tuple per block would be a GC-tracked allocation
        # per block (~13% of a replay).
        self.hash: list[Optional[int]] = [None] * num_blocks
        self.content = [NO_CONTENT] * num_blocks
        self.parent_content = [NO_CONTENT] * num_blocks
        self.block_bytes: list[Optional[bytes]] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> the one registered block with that hash
        self.registered = [False] * num_blocks  # registered[b] == (cached.get(hash of b) == b), kept for speed
        self.policy = policy
        # Only policies that listen get called; skipping the no-op keeps hits cheap for the rest.
        self.hit_listener = policy.on_hit if type(policy).on_hit is not EvictionPolicy.on_hit else None
        self.access_listener = (policy.on_access if type(policy).on_access is not EvictionPolicy.on_access
                                else None)
        self.first_block = first_block    # blocks below it are reserved (the sliding window's null block)
        self.num_free = num_blocks - first_block  # the pool's own count: never trusts len(policy)
        self.sink = sink  # the manager's EventSink (kvlab.blocks.event_sink), None when nobody listens
        self.evictions = 0
        self._next_content = ROOT + 1
        policy.add_many(list(range(first_block, num_blocks)), [False] * self.num_free)

    def transaction(self):
        """``with pool.transaction() as txn:`` the policy calls of one operation, undone if one raises."""
        return policy_transaction(self)

    def is_cached(self, block: int) -> bool:
        return self.registered[block]

    def block_hash(self, block: int) -> Optional[int]:
        return self.hash[block]

    def content_id(self, block: int) -> int:
        return self.content[block]

    def lookup(self, hashes: list[int], contents: list[bytes], limit: int) -> list[int]:
        """The cached blocks matching the first full blocks of a prompt, in order, stopping at the first miss
        (at most ``limit``). Pure: changes nothing."""
        hits: list[int] = []
        parent = ROOT
        cached, block_bytes, parent_content, content = (self.cached, self.block_bytes, self.parent_content,
                                                        self.content)
        for i in range(min(limit, len(hashes))):
            block = cached.get(hashes[i])
            if block is None or parent_content[block] != parent or block_bytes[block] != contents[i]:
                break
            hits.append(block)
            parent = content[block]
        return hits

    def freed_by(self, blocks) -> tuple[list[int], list[bool]]:
        """The blocks of ``blocks`` (distinct) that ``drop(blocks)`` would free, in order, and whether each is
        cached (the flags the policy wants). Pure."""
        ref = self.ref
        freed = [block for block in blocks if ref[block] == 1]
        if len(freed) < 2:
            return freed, [self.registered[block] for block in freed]
        return freed, list(itemgetter(*freed)(self.registered))

    def release(self, blocks) -> list[int]:
        """One reference less to each of ``blocks`` (distinct), when that is the operation's only policy call:
        the freed ones go to the policy, then the counts change. Returns the freed blocks."""
        freed, cached = self.freed_by(blocks)
        with self.transaction() as txn:
            txn.add(freed, cached)
        self.drop(blocks, freed)
        return freed

    # ---- bookkeeping, after the transaction made the policy calls ----------------------------------------
    def fill(self, taken, hashes=(), contents=(), parent: int = ROOT) -> int:
        """Blocks the policy handed out for new content: ref count 1 each, their old prefixes evicted (reported
        to the sink first: each block, its hash and its bytes); the first ``len(hashes)``
        are full with ``contents[i]``, chained after the prefix whose content id is ``parent``, and sealed
        (see ``seal``). Returns the content id the next block chains after."""
        ref, block_hash, registered, cached = self.ref, self.hash, self.registered, self.cached
        evicted = []
        for block in taken:
            ref[block] = 1
            if registered[block]:
                registered[block] = False
                del cached[block_hash[block]]
                evicted.append(block)
        if evicted and self.sink is not None:  # before their hashes and bytes are overwritten
            block_bytes = self.block_bytes
            self.sink.evicted(evicted, [block_hash[block] for block in evicted],
                              [block_bytes[block] for block in evicted])
        for block in taken[len(hashes):]:  # the rest hold no sealed content now (seal overwrites the others)
            block_hash[block] = None
            self.content[block] = NO_CONTENT
        self.evictions += len(evicted)
        self.num_free -= len(taken)
        return self.seal(taken[:len(hashes)], hashes, contents, parent) if hashes else parent

    def claim(self, blocks, revived: int) -> None:
        """One more reference to each block (prefix hits, forks, twins); ``revived`` of them were free."""
        ref = self.ref
        for block in blocks:
            ref[block] += 1
        self.num_free -= revived

    def drop(self, blocks, freed) -> None:
        """One reference less to each block; ``freed`` (from ``freed_by(blocks)``) went to the policy already."""
        ref = self.ref
        for block in blocks:
            ref[block] -= 1
        self.num_free += len(freed)
        if self.sink is not None and freed:
            self.sink.released(freed)

    def seal(self, blocks, hashes, contents, parent: int) -> int:
        """Record that each of ``blocks`` is full with ``contents[i]`` (hash ``hashes[i]``), chained after the
        prefix whose content id is ``parent``, and register each in the prefix cache unless another block
        already holds its hash (then only the first stays hittable). Returns the last block's content id,
        the next block's ``parent``."""
        setdefault, registered, block_hash = self.cached.setdefault, self.registered, self.hash
        content_id, parent_content, block_bytes = self.content, self.parent_content, self.block_bytes
        first_new = cid = self._next_content
        for block, h, content in zip(blocks, hashes, contents):
            block_hash[block] = h
            twin = setdefault(h, block)
            if twin == block:
                registered[block] = True
            elif parent_content[twin] == parent and block_bytes[twin] == content:
                # The same prefix is already cached in another block: this one is an unregistered duplicate
                # with the same content id, so blocks sealed after it still chain to the cached prefix.
                content_id[block] = parent = content_id[twin]
                parent_content[block], block_bytes[block] = parent_content[twin], content
                continue
            content_id[block], parent_content[block], block_bytes[block] = cid, parent, content
            parent = cid
            cid += 1
        self._next_content = cid
        if self.sink is not None:  # the blocks with a new content id (a duplicate of a cached prefix has none)
            self.sink.sealed(blocks if cid - first_new == len(blocks) else
                             [b for b in blocks if content_id[b] >= first_new])
        return parent

    def forget_prefixes(self) -> None:
        """Every block stops being cached (only valid when every block is free; the caller re-filed them)."""
        self.hash = [None] * self.num_blocks
        self.content = [NO_CONTENT] * self.num_blocks
        self.parent_content = [NO_CONTENT] * self.num_blocks
        self.block_bytes = [None] * self.num_blocks
        self.cached.clear()
        self.registered = [False] * self.num_blocks

    def check(self, table_refs: Counter) -> None:
        """Raise InvariantViolation unless the pool agrees with ``table_refs`` (block -> table entries using
        it, counted by the manager) and with itself. O(pool size)."""
        for block in range(self.num_blocks):
            if self.ref[block] != table_refs.get(block, 0):
                _fail(f"GPU block {block}: ref count {self.ref[block]}, but {table_refs.get(block, 0)} table "
                      "entries use it")
        if any(self.ref[b] for b in range(self.first_block)):
            _fail("the reserved null block must never be referenced")
        free = list(self.policy)
        if len(free) != len(set(free)) or len(free) != len(self.policy) or len(free) != self.num_free:
            _fail(f"the free set lists a block twice or miscounts ({len(free)} listed, {len(self.policy)} by "
                  f"len(), {self.num_free} counted by the pool)")
        expected_free = {b for b in range(self.first_block, self.num_blocks) if self.ref[b] == 0}
        if set(free) != expected_free:
            _fail(f"free set {sorted(set(free) ^ expected_free)[:10]}... disagrees with ref counts "
                  "(a block must be free xor used)")
        for h, block in self.cached.items():
            if self.block_hash(block) != h or self.content_id(block) <= ROOT:
                _fail(f"prefix cache maps hash {h} to block {block}, which does not hold that sealed content")
        if sum(self.registered) != len(self.cached) or any(
                self.registered[b] != (self.cached.get(self.block_hash(b)) == b) for b in range(self.num_blocks)):
            _fail("a block's registered flag disagrees with the prefix cache map")
        # A lookup trusts a content id to stand for one parent and one run of bytes (tokens and keys): were it
        # to stand for two, a hit could hand out K/V of other tokens, or of another tenant.
        sealed = {}
        for b in range(self.num_blocks):
            cid, what = self.content[b], (self.parent_content[b], self.block_bytes[b])
            if cid > ROOT and sealed.setdefault(cid, what) != what:
                _fail(f"GPU block {b} has content id {cid} but not the parent and bytes of its other blocks")
        misfiled = [b for b in free if self.policy.filed_as_cached(b) not in (None, self.registered[b])]
        if misfiled:
            _fail(f"free blocks {misfiled[:10]} are filed as cached/uncached against the prefix cache map")


def _fail(message: str):
    raise InvariantViolation(message)
