"""The block manager: which physical KV blocks each sequence's tokens live in.

Engine ordering rule (the prefix cache relies on it): within a forward pass, every layer writes the new
tokens' K/V into their slots (``reshape_and_cache``) *before* that layer's attention reads the cache. That
is why a full block becomes hittable the moment its tokens are known (prompt blocks when ``allocate``
returns, a decode block when ``append_slots`` seals it): a request that hits it in the same step reads K/V
that the same forward pass has already written.

Lifecycle: ``allocate`` (RUNNING) -> ``append_token`` + ``append_slots`` per step -> ``free`` (FINISHED, or
WAITING with ``preempted=True``); ``fork`` shares a running sequence's blocks with a new child;
``swap_out`` (SWAPPED) / ``swap_in`` (RUNNING) move it to the CPU pool and back. The manager sets
``seq.status`` as it acts but decides what is valid from its own records, never from a status a caller set.
"""

from array import array
from dataclasses import dataclass
from typing import Optional

from kvlab.allocations import Allocation, Registry, int_at_least, is_int
from kvlab.block_pool import BROKEN, ROOT, AllocStatus, BlockPool, Event
from kvlab.errors import InvalidArgumentError, OutOfBlocksError
from kvlab.eviction import POLICIES, EvictionPolicy
from kvlab.hashing import HashFn, block_hashes
from kvlab.invariants import check_manager
from kvlab.sequence import Sequence, SequenceStatus, check_block_size
from kvlab.swap import CpuPool, Swapping, Twins

NULL_BLOCK = 0  # with a sliding window, block 0 is reserved: every released table entry points at it


@dataclass
class PrefixCacheStats:
    """Counters of ``allocate``'s prefix-cache lookups (a prompt's full blocks are queried)."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager(Registry, Swapping):
    def __init__(self, num_blocks: int, block_size: int = 16, *, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None, hash_fn: Optional[HashFn] = None,
                 eviction="lru", record_events: bool = False):
        self.block_size = check_block_size(block_size)
        self.num_blocks = int_at_least("num_blocks", num_blocks, 2 if sliding_window is not None else 1)
        int_at_least("num_cpu_blocks", num_cpu_blocks, 0)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise InvalidArgumentError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        if sliding_window is not None:
            int_at_least("sliding_window", sliding_window, 1)
        if hash_fn is not None and not callable(hash_fn):
            raise InvalidArgumentError("hash_fn must be callable as hash_fn(parent_hash_or_None, token_ids)")
        if isinstance(eviction, str):
            if eviction not in POLICIES:
                raise InvalidArgumentError(f"unknown eviction policy {eviction!r}; known: {sorted(POLICIES)}")
            eviction = POLICIES[eviction]()
        elif not isinstance(eviction, EvictionPolicy) or len(eviction):
            raise InvalidArgumentError("eviction must be a policy name or an empty EvictionPolicy instance")
        self.sliding_window = sliding_window
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_fn = hash_fn
        self.events: Optional[list[Event]] = [] if record_events else None
        first_block = NULL_BLOCK + 1 if sliding_window is not None else 0
        self._pool = BlockPool(self.num_blocks, eviction, first_block, self.events)
        self._cpu = CpuPool(num_cpu_blocks)
        self._twins = Twins()
        self._usable = self.num_blocks - first_block
        self._watermark_blocks = int(watermark * self.num_blocks)
        self._allocs: dict[int, Allocation] = {}
        self._hash_memo = None  # (token array, its length, hashes, contents) of the last prompt hashed
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_evictions(self) -> int:
        """Cached prefixes dropped because their block was reused for new content."""
        return self._pool.evictions

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref[self._check_block_id(block_id)]

    def block_hash(self, block_id: int) -> Optional[int]:
        return self._pool.hash[self._check_block_id(block_id)]

    def is_cached(self, block_id: int) -> bool:
        """Whether a prefix lookup can hit this block now (it may be in use or free-but-warm)."""
        return self._pool.is_cached(self._check_block_id(block_id))

    def free_block_ids(self) -> list[int]:
        """Free GPU blocks, in the order they will be reused."""
        return list(self._pool.policy)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's block table (CPU block ids while it is swapped out)."""
        return list(self._alloc(seq).seq.block_table)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of positions start..end-1; -1 where the sliding window
        released the block."""
        alloc = self._on_gpu(seq)
        table, bs = seq.block_table, self.block_size
        if not (is_int(start) and is_int(end) and 0 <= start <= end <= len(table) * bs):
            raise InvalidArgumentError(f"need 0 <= start <= end <= {len(table) * bs} (slots this sequence "
                                       f"holds), got start={start!r}, end={end!r}")
        released = alloc.num_released
        return [-1 if p // bs < released else table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- admission and allocation --------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead_slots: int = 0) -> AllocStatus:
        """Whether ``allocate(seq)`` (plus ``num_lookahead_slots`` later) fits. A prefix hit on a block in use
        costs nothing; a hit on a free cached block takes that block out of the free pool."""
        self._check_new(seq)
        int_at_least("num_lookahead_slots", num_lookahead_slots, 0)
        live_blocks, needed_free, _ = self._demand(seq, num_lookahead_slots)
        return self._admission(live_blocks, needed_free)

    def allocate(self, seq: Sequence) -> None:
        """Give the prompt its blocks, sharing the longest cached prefix. Atomic: raises before changing
        anything if the blocks are not there."""
        self._check_new(seq)
        _, needed_free, (hashes, contents, hits) = self._demand(seq, 0)
        if needed_free > self._pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed_free} free blocks, "
                                   f"{self._pool.num_free} are free (check can_allocate first)")
        pool, events, bs, n = self._pool, self.events, self.block_size, seq.num_tokens
        first_live, num_full, num_hits = self._first_live(n), len(hashes), len(hits)
        # Hits outside the sliding window prove the chain but are not pinned: the table points at the null block.
        live_hits = hits[first_live:]
        pool.acquire(live_hits)
        table = [NULL_BLOCK] * (num_hits - len(live_hits)) + live_hits
        parent = pool.content[hits[-1]] if hits else ROOT
        if pool.hit_listener is not None:
            for block in hits:
                pool.hit_listener(block)
        if events is not None:
            events.extend(Event("hit", seq.seq_id, block) for block in hits)
        if first_live > num_hits:  # blocks never stored: nothing after them can be shared
            table += [NULL_BLOCK] * (first_live - num_hits)
            parent = BROKEN
        start = len(table)
        new_blocks = pool.take(-(-n // bs) - start)
        if events is not None:
            events.extend(Event("miss", seq.seq_id, block) for block in new_blocks)
        parent = pool.seal(new_blocks, hashes[start:], contents[start:], parent)
        table += new_blocks
        if self.enable_prefix_caching:
            stats = self.stats
            stats.queried_tokens += n
            stats.hit_tokens += len(hits) * bs
            stats.queried_blocks += num_full
            stats.hit_blocks += len(hits)
        seq.block_table = table
        seq.num_cached_tokens = len(hits) * bs
        seq.status = SequenceStatus.RUNNING
        self._allocs[seq.seq_id] = Allocation(seq, num_full, hashes[-1] if hashes else None, parent, first_live)
        if events is not None:
            events.append(Event("allocate", seq.seq_id))

    # ---- decode growth and copy-on-write ---------------------------------------------------------------
    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> bool:
        _, copies, new_blocks = self._append_demand(self._on_gpu(seq), num_lookahead_slots)
        return len(copies) + new_blocks <= self._pool.num_free

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """After ``seq.append_token``: make sure every token (plus ``num_lookahead_slots`` speculative ones)
        has a slot, seal blocks that became full (they become hittable at once, see the ordering rule
        above) and release blocks that left the sliding window. A shared block about to be written is
        copied first; returns those copy-on-write (src, dst) pairs for ``copy_blocks``."""
        alloc = self._on_gpu(seq)
        touched, copies, new_blocks = self._append_demand(alloc, num_lookahead_slots)
        if len(copies) + new_blocks > self._pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {len(copies) + new_blocks} free blocks, "
                                   f"{self._pool.num_free} are free (check can_append_slots first)")
        pool, table, events, bs, n = self._pool, seq.block_table, self.events, self.block_size, seq.num_tokens
        sealing = self.enable_prefix_caching and n // bs > alloc.num_sealed
        if sealing:  # hashed before anything changes: a failing hash_fn must leave no trace
            hashes, contents = block_hashes(seq._tokens, bs, alloc.num_sealed, n // bs, alloc.last_hash,
                                            self.hash_fn)
        pairs = []
        for i in touched:
            src = table[i]
            if i in copies:
                table[i] = dst = pool.take(1)[0]
                self._release_gpu([src])
                pairs.append((src, dst))
                if events is not None:
                    events.append(Event("cow", seq.seq_id, dst, src))
            elif self._twins:
                self._twins.forget_gpu(src)  # written in place: its CPU twin goes stale
        for block in pool.take(new_blocks):
            table.append(block)
            if events is not None:
                events.append(Event("append", seq.seq_id, block))
        if sealing:
            sealed = table[alloc.num_sealed:n // bs]
            alloc.last_content = pool.seal(sealed, hashes, contents, alloc.last_content)
            alloc.num_sealed, alloc.last_hash = n // bs, hashes[-1]
        alloc.num_written = n
        self._release_outside_window(alloc)
        return pairs

    # ---- free and fork ---------------------------------------------------------------------------------
    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        """Drop the sequence's references, tail block first (so LRU reuses the chain's tail first). Status
        becomes FINISHED, or WAITING with ``preempted=True`` (to be recomputed later)."""
        alloc = self._alloc(seq)
        del self._allocs[seq.seq_id]
        live = seq.block_table[alloc.num_released:]
        (self._release_cpu if alloc.on_cpu else self._release_gpu)(live[::-1])
        seq.block_table = []
        seq.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
        if preempted:
            seq.num_cached_tokens = 0
        if self.events is not None:
            self.events.append(Event("free", seq.seq_id))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give the new ``child`` the parent's tokens (and block size) and share all its blocks: nothing is
        allocated; a later append into a shared partial block copies it. Whatever tokens the child had
        are replaced (``Sequence([])`` is the usual child)."""
        alloc = self._on_gpu(parent)
        if isinstance(child, Sequence):
            child.block_size = parent.block_size
        self._check_new(child, need_tokens=False)
        child._tokens = array("q", parent._token_array())
        child.num_tokens, child.num_prompt_tokens = parent.num_tokens, parent.num_prompt_tokens
        child.last_token, child.num_cached_tokens = parent.last_token, parent.num_cached_tokens
        child.block_table = list(parent.block_table)
        self._pool.acquire(child.block_table[alloc.num_released:])
        child.status = SequenceStatus.RUNNING
        self._allocs[child.seq_id] = alloc.copy_for(child)
        if self.events is not None:
            self.events.append(Event("fork", child.seq_id, other=parent.seq_id))

    # ---- maintenance -----------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and reset the stats; refused (False) while any GPU block is in use."""
        if self._pool.num_free != self._usable:
            return False
        self._pool.drop_all_hashes()
        self._pool.evictions = 0
        self.stats = PrefixCacheStats()
        return True

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the bookkeeping is inconsistent (O(pool size); for tests)."""
        check_manager(self)

    # ---- internals -------------------------------------------------------------------------------------
    def _first_live(self, num_tokens: int) -> int:
        """Leading blocks wholly outside the sliding window (they hold no position >= n - window)."""
        return max(0, (num_tokens - self.sliding_window) // self.block_size) if self.sliding_window else 0

    def _demand(self, seq, lookahead):
        """(live blocks needed, free blocks consumed, lookup) for allocating ``seq`` plus lookahead."""
        n, bs = seq.num_tokens, self.block_size
        if self.enable_prefix_caching:
            hashes, contents = self._prompt_hashes(seq)
            # Never share the whole prompt: at least one token must be computed to produce logits.
            hits = self._pool.lookup(hashes, contents, (n - 1) // bs)
        else:
            hashes, contents, hits = [], [], []
        first_live = self._first_live(n)
        live_blocks = -(-(n + lookahead) // bs) - first_live
        ref = self._pool.ref
        used_hits = sum(1 for b in hits[first_live:] if ref[b])
        return live_blocks, live_blocks - used_hits, (hashes, contents, hits)

    def _prompt_hashes(self, seq):
        """Hashes and bytes of the prompt's full blocks. A scheduler calls can_allocate and then allocate on
        the same prompt, so the last result is kept (hashing is a quarter of a replay's time). The key is
        the token array itself plus its length: tokens only change by appending, or by fork replacing the
        array."""
        tokens, memo = seq._tokens, self._hash_memo
        if memo is None or memo[0] is not tokens or memo[1] != len(tokens):
            hashes, contents = block_hashes(tokens, self.block_size, 0, len(tokens) // self.block_size, None,
                                            self.hash_fn)
            memo = self._hash_memo = (tokens, len(tokens), hashes, contents)
        return memo[2], memo[3]

    def _admission(self, live_blocks, needed_free) -> AllocStatus:
        if live_blocks > self._usable - self._watermark_blocks:
            return AllocStatus.NEVER
        if self._pool.num_free - needed_free >= self._watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _append_demand(self, alloc, lookahead):
        """(indices of existing blocks the next writes touch, those of them that are shared, number of new
        blocks needed)."""
        int_at_least("num_lookahead_slots", lookahead, 0)
        table, bs, ref = alloc.seq.block_table, self.block_size, self._pool.ref
        end = alloc.seq.num_tokens + lookahead  # positions num_written..end-1 will be written
        touched = range(alloc.num_written // bs, min(len(table), -(-end // bs)))
        return touched, {i for i in touched if ref[table[i]] > 1}, max(0, -(-end // bs) - len(table))

    def _release_outside_window(self, alloc) -> None:
        first_live = self._first_live(alloc.seq.num_tokens)
        table = alloc.seq.block_table
        self._release_gpu(table[alloc.num_released:first_live][::-1])  # tail first, as in free()
        for i in range(alloc.num_released, first_live):
            table[i] = NULL_BLOCK
        alloc.num_released = max(alloc.num_released, first_live)

    def _release_gpu(self, blocks) -> None:
        freed = self._pool.release(blocks)
        if self._twins:
            for block in freed:
                self._twins.forget_gpu(block)

    def _release_cpu(self, blocks) -> None:
        for block in blocks:
            if self._cpu.release(block) and self._twins:
                self._twins.forget_cpu(block)

    def _check_block_id(self, block_id) -> int:
        if not is_int(block_id) or not 0 <= block_id < self.num_blocks:
            raise InvalidArgumentError(f"block id must be an int in [0, {self.num_blocks}), got {block_id!r}")
        return block_id
