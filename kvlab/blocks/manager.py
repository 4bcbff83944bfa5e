"""The block manager: which physical KV blocks each sequence's tokens live in.

Engine ordering rule (the prefix cache relies on it): within a forward pass, every layer writes the new
tokens' K/V into their slots (``reshape_and_cache``) *before* that layer's attention reads the cache. That
is why a full block becomes hittable as soon as the step that writes its last token is scheduled (prompt
blocks when ``allocate`` returns, a decode block when ``append_slots`` seals it): a request that hits it in
the same step reads K/V that the same forward pass has already written. A block whose tokens are still to be
computed (the rest of a chunked prompt) is never hittable. The flip side, as in vLLM V1: once ``allocate`` or
``append_slots`` returned, the step that writes those slots must run before the sequence is freed.

Chunked prompts (vLLM V1's ``allocate_slots(request, num_new_tokens)``): ``allocate(seq, num_new_tokens=k)``
looks up prefix hits once and gives slots to the hits plus the next k prompt tokens; each later step's
``append_slots(seq, num_new_tokens=k)`` gives slots to the next k tokens without one (None: all of them,
today's whole-prompt and decode behaviour). ``num_scheduled_tokens(seq)`` says how far the sequence got.

Sliding window W: a step whose first new token sits at position p attends to keys from p - W + 1 on, so a
block is released only once it lies wholly before that, at the start of the next step that moves p past it
(never while a query of the current step can still see it).

Lifecycle: ``allocate`` (RUNNING) -> ``append_token`` + ``append_slots`` per step -> ``free`` (FINISHED, or
WAITING with ``preempted=True``); ``fork`` shares a running sequence's blocks with a new child;
``swap_out`` (SWAPPED) / ``swap_in`` (RUNNING) move it to the CPU pool and back. The manager decides what is
valid from its own records, never from a status a caller set. Every public method holds one lock, so
threads may share a manager (each Sequence belongs to one thread at a time). A failed call changes nothing.
"""

import functools
import threading
from typing import Optional

from kvlab.blocks.allocations import (Allocation, allocation_of, check_block_size_matches, check_sequence,
                                      check_unallocated)
from kvlab.blocks.block_pool import ROOT, BlockPool
from kvlab.blocks.cross_attention import CrossTables
from kvlab.blocks.eviction import make_policy
from kvlab.blocks.hashing import HashFn, PromptHashes
from kvlab.blocks.invariants import check_manager
from kvlab.blocks.kv_events import KVEventPublisher
from kvlab.blocks.planning import hashes_to_seal, plan_allocation, plan_step
from kvlab.blocks.records import AllocStatus, Event, PrefixCacheStats
from kvlab.blocks.sequence import Sequence, SequenceStatus, check_block_size, copy_tokens, set_allocation_record
from kvlab.blocks.swap import SwapSpace
from kvlab.errors import InvalidArgumentError, OutOfBlocksError, SequenceStateError
from kvlab.validation import check_int, check_number

__all__ = ["BlockManager", "AllocStatus", "PrefixCacheStats", "NULL_BLOCK", "MAX_BLOCKS"]

NULL_BLOCK = 0  # with a sliding window, block 0 is reserved: every released table entry points at it
#: Largest pool (GPU or CPU): the manager keeps ~100 bytes of Python state per block (2**24 blocks: ~2 GB).
MAX_BLOCKS = 1 << 24


def _serialized(cls):
    """Make every public method of ``cls`` hold ``self._lock`` (re-entrant: public methods call each other)."""
    def locked(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with self._lock:
                return method(self, *args, **kwargs)
        return call
    for name, member in list(vars(cls).items()):
        if callable(member) and not name.startswith("_"):
            setattr(cls, name, locked(member))
    return cls


@_serialized
class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, *, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None, hash_fn: Optional[HashFn] = None,
                 eviction="lru", record_events: bool = False, kv_events: bool = False):
        self.block_size = check_block_size(block_size)
        self.num_blocks = check_int("num_blocks", num_blocks, 2 if sliding_window is not None else 1, MAX_BLOCKS)
        check_int("num_cpu_blocks", num_cpu_blocks, 0, MAX_BLOCKS)
        check_number("watermark", watermark, 0, 1, max_open=True)
        if sliding_window is not None:
            check_int("sliding_window", sliding_window, 1)
        if hash_fn is not None and not callable(hash_fn):
            raise InvalidArgumentError("hash_fn must be callable as hash_fn(parent_hash_or_None, token_ids)")
        eviction = make_policy(eviction)
        self.sliding_window = sliding_window
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_fn = hash_fn
        self.events: Optional[list[Event]] = [] if record_events else None
        first_block = NULL_BLOCK + 1 if sliding_window is not None else 0
        self._pool = BlockPool(self.num_blocks, eviction, first_block, self.events)
        # What enters and leaves the prefix cache, for routers (vLLM's KV events: kvlab.blocks.kv_events).
        self.kv_events = self._pool.kv_events = KVEventPublisher(self.block_size) if kv_events else None
        self._swap = SwapSpace(num_cpu_blocks)
        self._cross = CrossTables(self.block_size)
        self._usable = self.num_blocks - first_block
        self._watermark_blocks = int(watermark * self.num_blocks)
        self._allocs: set[Allocation] = set()
        self._prompt_hashes = PromptHashes(self.block_size, hash_fn)
        self._lock = threading.RLock()
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_evictions(self) -> int:
        """Cached prefixes dropped because their block was reused for new content."""
        return self._pool.evictions

    @property
    def num_cached_blocks(self) -> int:
        """Blocks a prefix lookup can hit now (in use or free-but-warm)."""
        return len(self._pool.cached)

    @property
    def num_cpu_blocks(self) -> int:
        return self._swap.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._swap.num_free

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref[check_int("block id", block_id, 0, self.num_blocks - 1)]

    def cpu_ref_count(self, block_id: int) -> int:
        """How many swapped-out table entries point at CPU block ``block_id``."""
        return self._swap.ref[check_int("CPU block id", block_id, 0, self._swap.num_blocks - 1)]

    def block_hash(self, block_id: int) -> Optional[int]:
        return self._pool.block_hash(check_int("block id", block_id, 0, self.num_blocks - 1))

    def is_cached(self, block_id: int) -> bool:
        """Whether a prefix lookup can hit this block now (it may be in use or free-but-warm)."""
        return self._pool.is_cached(check_int("block id", block_id, 0, self.num_blocks - 1))

    def free_block_ids(self) -> list[int]:
        """Free GPU blocks, in the order they will be reused."""
        return list(self._pool.policy)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's block table (CPU block ids while it is swapped out)."""
        return list(allocation_of(self, seq).table)

    def is_swapped(self, seq: Sequence) -> bool:
        """Whether an allocated sequence's blocks are in the CPU pool (its table then holds CPU ids)."""
        return allocation_of(self, seq).on_cpu

    def num_released_blocks(self, seq: Sequence) -> int:
        """Leading table entries the sliding window released (they point at the null block on the GPU)."""
        return allocation_of(self, seq).num_released

    def num_scheduled_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens have slots: their K/V is written by now or by the step just scheduled
        (vLLM V1's ``request.num_computed_tokens``, which its scheduler advances when it schedules a step).
        The tokens after them (the rest of a chunked prompt, or tokens appended since) still need a step."""
        return allocation_of(self, seq).num_written

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of positions start..end-1; -1 where the sliding window
        released the block (only positions no query of this or a later step can see). Only positions with a
        slot (scheduled ones and lookahead slots) can be asked for."""
        alloc, bs = self._on_gpu(seq), self.block_size
        table = alloc.table
        if not (check_int("start", start, 0) <= check_int("end", end, 0) <= alloc.num_slots):
            raise InvalidArgumentError(f"need 0 <= start <= end <= {alloc.num_slots} (positions with slots), got "
                                       f"start={start!r}, end={end!r}")
        released = alloc.num_released
        return [-1 if p // bs < released else table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- admission and allocation --------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead_slots: int = 0, encoder_seq=None, *,
                     num_new_tokens: Optional[int] = None) -> AllocStatus:
        """Whether ``allocate(seq, encoder_seq, num_new_tokens=...)`` (plus ``num_lookahead_slots`` later) fits.
        A prefix hit on a block in use costs nothing; a hit on a free cached block takes that block out of the
        free pool. OK and LATER are about this step (keeping the watermark free); NEVER says the prompt can
        never be finished here, however it is chunked (without a sliding window: its whole prompt never fits)."""
        check_unallocated(self, seq)
        lookahead = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        cross = self._cross.blocks_for(seq, encoder_seq)
        plan = self._plan_allocation(seq, lookahead, num_new_tokens)
        return self._admission(plan.peak_blocks + cross, plan.needed_free + cross)

    def allocate(self, seq: Sequence, encoder_seq: Optional[Sequence] = None, *,
                 num_new_tokens: Optional[int] = None) -> None:
        """Give the prompt its blocks, sharing the longest cached prefix; with ``encoder_seq`` (an
        encoder-decoder request) also a cross-attention table for the encoder's tokens, shared by the
        sequence's future forks. With ``num_new_tokens=k`` only the hits and the next k prompt tokens get
        slots (the first chunk; ``get_num_cached_tokens`` tells the hits beforehand), and ``append_slots``
        schedules the rest later. Atomic: raises before changing anything if the blocks are not there, or
        if the prompt could never be finished in this pool."""
        check_unallocated(self, seq)
        num_cross = self._cross.blocks_for(seq, encoder_seq)
        hashes, contents, hits, first_live, scheduled, _, needed_free, peak = self._plan_allocation(
            seq, 0, num_new_tokens)
        pool, bs, n = self._pool, self.block_size, seq.num_tokens
        if needed_free + num_cross > pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed_free + num_cross} free blocks, "
                                   f"{pool.num_free} are free (check can_allocate first)")
        if peak + num_cross > self._usable:  # a first chunk that fits, of a prompt that never can
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {peak + num_cross} blocks at once to finish its "
                                   f"prompt, the pool has {self._usable} (check can_allocate first)")
        # Hits outside the sliding window prove the chain but are not pinned: the table points at the null block.
        live_hits, num_new = hits[first_live:], -(-scheduled // bs) - len(hits)
        revived = [block for block in live_hits if not pool.ref[block]]
        parent = pool.content_id(hits[-1]) if hits else ROOT
        with pool.transaction() as txn:
            txn.revive(revived)
            new_blocks = txn.pop(num_new + num_cross)
            txn.hits(hits)
        pool.claim(live_hits, len(revived))
        new_blocks, cross_blocks = new_blocks[:num_new], new_blocks[num_new:]
        if self.events is not None:
            self.events.extend(Event("hit", seq.seq_id, block) for block in hits)
            self.events.extend(Event("miss", seq.seq_id, block) for block in new_blocks)
        num_sealed = min(len(hashes), scheduled // bs)  # the blocks this step writes to the end
        parent = pool.fill(new_blocks, hashes[len(hits):num_sealed], contents[len(hits):num_sealed], parent)
        if self.kv_events is not None:
            self.kv_events.stored(pool, new_blocks[:num_sealed - len(hits)], hashes[len(hits):num_sealed],
                                  contents[len(hits):num_sealed], hashes[len(hits) - 1] if hits else None)
        pool.fill(cross_blocks)
        if self.events is not None:
            self.events.append(Event("allocate", seq.seq_id))
        if self.enable_prefix_caching:
            stats = self.stats
            stats.queried_tokens += n
            stats.hit_tokens += len(hits) * bs
            stats.queried_blocks += len(hashes)
            stats.hit_blocks += len(hits)
        table = [NULL_BLOCK] * first_live + live_hits + new_blocks
        alloc = Allocation(self, seq, table, num_sealed, hashes[num_sealed - 1] if num_sealed else None, parent,
                           first_live, len(hits) * bs, scheduled,
                           (hashes, contents) if num_sealed < len(hashes) else None)
        self._cross.attach(alloc, encoder_seq, cross_blocks)
        self._adopt(alloc, len(hits) * bs)

    # ---- decode growth and copy-on-write ---------------------------------------------------------------
    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                         num_new_tokens: Optional[int] = None) -> bool:
        """Whether ``append_slots`` with the same arguments fits now (a running sequence: no watermark)."""
        plan = self._plan_step(self._on_gpu(seq), num_lookahead_slots, num_new_tokens)
        return plan.blocks_needed <= self._pool.num_free + len(plan.freed)

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None) -> list[tuple[int, int]]:
        """Schedule a step: release the blocks that left the sliding window, give slots to the next
        ``num_new_tokens`` tokens that have none (None: all of them, i.e. every token appended by
        ``seq.append_token`` since the last step, or the rest of a chunked prompt) plus
        ``num_lookahead_slots`` speculative ones, and seal blocks whose last token is now scheduled (they
        become hittable at once, see the ordering rule above). A shared block about to be written is copied
        first; returns those copy-on-write (src, dst) pairs for ``copy_blocks``."""
        alloc = self._on_gpu(seq)
        plan = self._plan_step(alloc, num_lookahead_slots, num_new_tokens)
        pool, table, events, bs, n = self._pool, alloc.table, self.events, self.block_size, plan.scheduled
        if plan.blocks_needed > pool.num_free + len(plan.freed):
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {plan.blocks_needed} free blocks, "
                                   f"{pool.num_free + len(plan.freed)} are free (check can_append_slots first)")
        sealing = self.enable_prefix_caching and n // bs > alloc.num_sealed
        if sealing:  # hashed before anything changes: a failing hash_fn must leave no trace
            hashes, contents = hashes_to_seal(alloc, n // bs, bs, self.hash_fn)
        with pool.transaction() as txn:
            txn.add(plan.freed, plan.freed_cached)
            taken = txn.pop(plan.blocks_needed)
        pool.drop(plan.release, plan.freed)
        self._swap.forget_gpu(plan.freed)
        table[alloc.num_released:plan.release_upto] = [NULL_BLOCK] * len(plan.release)
        alloc.num_released = plan.release_upto
        pool.fill(taken)
        fresh, pairs = iter(taken), []
        for i in plan.touched:
            src = table[i]
            if i in plan.copies:
                table[i] = dst = next(fresh)
                pool.drop([src], ())  # shared, so it stays in use
                pairs.append((src, dst))
                if events is not None:
                    events.append(Event("cow", seq.seq_id, dst, src))
            else:
                self._swap.forget_gpu([src])  # written in place: its CPU twin goes stale
        for block in fresh:
            table.append(block)
            if events is not None:
                events.append(Event("append", seq.seq_id, block))
        if sealing:
            sealed = table[alloc.num_sealed:n // bs]
            alloc.last_content = pool.seal(sealed, hashes, contents, alloc.last_content)
            if self.kv_events is not None:
                self.kv_events.stored(pool, sealed, hashes, contents, alloc.last_hash)
            alloc.num_sealed, alloc.last_hash = n // bs, hashes[-1]
            if alloc.prompt_hashes is not None and alloc.num_sealed >= len(alloc.prompt_hashes[0]):
                alloc.prompt_hashes = None  # every prompt block is sealed: nothing left to reuse them for
        alloc.num_computed = max(alloc.num_computed, alloc.num_written)  # a new step: the last one ran
        alloc.num_written = n
        alloc.num_slots = max(alloc.num_slots, n + num_lookahead_slots)
        return pairs

    # ---- free and fork ---------------------------------------------------------------------------------
    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        """Drop the sequence's references, tail block first (so LRU reuses the chain's tail first). Status
        becomes FINISHED, or WAITING with ``preempted=True`` (to be recomputed later). A cross-attention
        table stays with its group until ``free_cross``."""
        alloc = self._alloc(seq)
        live = alloc.live_blocks()[::-1]
        if alloc.on_cpu:
            self._swap.release(live)
        else:
            self._swap.forget_gpu(self._pool.release(live))
        self._cross.detach(alloc)
        self._allocs.discard(alloc)
        set_allocation_record(seq, None)
        seq.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
        if preempted:
            seq.num_cached_tokens = 0
        if self.events is not None:
            self.events.append(Event("free", seq.seq_id))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give the new ``child`` the parent's tokens (and block size, salt and keys) and share all its blocks:
        nothing is allocated; a later append into a shared partial block copies it. Whatever tokens and keys
        the child had are replaced (``Sequence([])`` is the usual child)."""
        alloc = self._on_gpu(parent)
        check_unallocated(self, child, need_tokens=False, same_block_size=False)
        child.block_size = parent.block_size
        copy_tokens(parent, child)
        twin = alloc.copy_for(child)
        self._pool.claim(twin.live_blocks(), 0)  # all in use by the parent: none was free
        self._cross.share(alloc, twin)
        self._adopt(twin, child.num_cached_tokens)
        if self.events is not None:
            self.events.append(Event("fork", child.seq_id, other=parent.seq_id))

    # ---- swapping (vLLM V0's preemption) ----------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> AllocStatus:
        """Whether ``swap_out(seq)`` fits in the CPU pool now (OK), once swapped sequences leave it (LATER),
        or never (NEVER)."""
        return self._swap.can_move_out(self._on_gpu(seq))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks (and its group's cross-attention blocks, if it is the group's last
        sequence on the GPU) to the CPU pool; returns the (gpu, cpu) copies to make. A block shared with a
        sequence swapped out earlier is not copied again."""
        mapping = self._swap.move_out(self._on_gpu(seq), self._pool)
        seq.status = SequenceStatus.SWAPPED
        if self.events is not None:
            self.events.extend(Event("swap_out", seq.seq_id, gpu, cpu) for gpu, cpu in mapping)
        return mapping

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        return self._admission(*self._swap.blocks_needed_in(self._on_cpu(seq)))

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back (with its group's cross-attention blocks if they are on the CPU);
        returns the (cpu, gpu) copies to make. Swapped-in blocks are not re-registered in the prefix cache."""
        alloc = self._on_cpu(seq)
        if self._admission(*self._swap.blocks_needed_in(alloc)) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        mapping = self._swap.move_in(alloc, self._pool)
        seq.status = SequenceStatus.RUNNING
        if self.events is not None:
            self.events.extend(Event("swap_in", seq.seq_id, gpu, cpu) for cpu, gpu in mapping)
        return mapping

    # ---- encoder-decoder: the group's cross-attention table ----------------------------------------------
    def get_cross_block_table(self, seq: Sequence) -> tuple:
        """The encoder's blocks of ``seq``'s group (CPU ids while swapped out), for any member or its root."""
        return tuple(self._cross.table_of(self, seq).blocks)

    def free_cross(self, seq: Sequence) -> None:
        """Free the cross-attention table of ``seq``'s group (call it with any live member, or with the
        sequence that was allocated with the encoder, even after it was freed)."""
        self._cross.free(self._cross.table_of(self, seq), self._pool, self._swap)

    # ---- vLLM V0's block-space-manager queries -----------------------------------------------------------
    def mark_blocks_as_computed(self, seq: Sequence) -> None:
        """The step that wrote ``seq``'s new slots ran. (``append_slots`` implies it for the step before.)"""
        alloc = self._on_gpu(seq)
        alloc.num_computed = alloc.num_written

    def access_all_blocks_in_seq(self, seq: Sequence, now: float) -> None:
        """``seq``'s blocks were used at time ``now``; LRU orders the blocks it was told about by it."""
        alloc = self._on_gpu(seq)
        now = check_number("now", now)
        with self._pool.transaction() as txn:
            txn.access(alloc.live_blocks(), now)

    def get_common_computed_block_ids(self, seqs) -> list[int]:
        """The longest run of leading blocks that every sequence in ``seqs`` holds and whose K/V is computed:
        what a batched prefill of the group can skip."""
        if isinstance(seqs, (Sequence, str, bytes)) or not isinstance(seqs, (list, tuple)):
            raise InvalidArgumentError(f"seqs must be a list of Sequence (e.g. [seq]), got {type(seqs).__name__}")
        common = None
        for seq in seqs:
            alloc = self._on_gpu(seq)
            computed = alloc.table[:alloc.num_computed // self.block_size]
            if common is None:
                common = computed
            else:
                same = next((i for i, (a, b) in enumerate(zip(common, computed)) if a != b), None)
                common = common[:min(len(common), len(computed)) if same is None else same]
        return list(common or [])

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s leading full blocks found in the prefix cache now (at most all but the last
        token, as ``allocate`` would hit); works for allocated and waiting sequences."""
        check_block_size_matches(self, check_sequence(seq))
        if not self.enable_prefix_caching or seq.num_tokens == 0:
            return 0
        hashes, contents = self._prompt_hashes(seq)
        return len(self._pool.lookup(hashes, contents, (seq.num_tokens - 1) // self.block_size)) * self.block_size

    def get_prefix_cache_hit_rate(self, device="gpu") -> float:
        """Block hit rate of ``allocate``'s lookups on ``device`` ("gpu" or "cpu", or an enum named so);
        -1.0 where there is no prefix cache (the CPU pool, or prefix caching off), as in vLLM."""
        name = str(getattr(device, "name", device)).lower()
        if name not in ("gpu", "cpu"):
            raise InvalidArgumentError(f"device must be 'gpu' or 'cpu', got {device!r}")
        if name == "cpu" or not self.enable_prefix_caching:
            return -1.0
        return self.stats.hit_blocks / self.stats.queried_blocks if self.stats.queried_blocks else 0.0

    # ---- maintenance -----------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and reset the stats; refused (False) while any GPU block is in use."""
        pool = self._pool
        if pool.num_free != self._usable:
            return False
        free = list(pool.policy)
        with pool.transaction() as txn:
            txn.revive(free)
            txn.add(free, [False] * len(free))
        pool.forget_prefixes()
        if self.kv_events is not None:
            self.kv_events.cleared()
        pool.evictions = 0
        self.stats = PrefixCacheStats()
        return True

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the bookkeeping is inconsistent (O(pool size); for tests)."""
        check_manager(self._allocs, self._cross, self._pool, self._swap, self.block_size, self.enable_prefix_caching)

    # ---- internals -------------------------------------------------------------------------------------
    def _adopt(self, alloc: Allocation, num_cached_tokens: int) -> None:
        self._allocs.add(alloc)
        seq = alloc.seq
        set_allocation_record(seq, alloc)
        seq.num_cached_tokens, seq.status = num_cached_tokens, SequenceStatus.RUNNING

    def _alloc(self, seq) -> Allocation:
        return allocation_of(self, seq)

    def _on_gpu(self, seq) -> Allocation:
        alloc = allocation_of(self, seq)
        if alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is swapped out; swap_in first")
        return alloc

    def _on_cpu(self, seq) -> Allocation:
        alloc = allocation_of(self, seq)
        if not alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is not swapped out")
        return alloc

    def _plan_allocation(self, seq, lookahead, num_new_tokens):
        hashes, contents = self._prompt_hashes(seq) if self.enable_prefix_caching else ([], [])
        return plan_allocation(self._pool, seq, hashes, contents, self.block_size, self.sliding_window, lookahead,
                               num_new_tokens)

    def _admission(self, live_blocks, needed_free) -> AllocStatus:
        if live_blocks > self._usable - self._watermark_blocks:
            return AllocStatus.NEVER
        if self._pool.num_free - needed_free >= self._watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _plan_step(self, alloc, lookahead, num_new_tokens):
        check_int("num_lookahead_slots", lookahead, 0)
        return plan_step(self._pool, alloc, self.block_size, self.sliding_window, lookahead, num_new_tokens)
