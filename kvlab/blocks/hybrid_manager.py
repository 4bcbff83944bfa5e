"""HybridBlockManager: KV cache groups (vLLM V1's hybrid allocator, ``HybridKVCacheCoordinator``).

A model mixing layer kinds has one group per kind (``kvlab.blocks.kv_cache_groups``); each group keeps its own
block table per sequence and all groups draw from ONE pool of equal-size pages. This manager coordinates one
``GroupManager`` per group (kvlab.blocks.group_manager): a ``BlockManager`` of the group's attention spec, built on
the parts all groups share (``shared_parts``: one ``BlockPool``, one ``SwapSpace``, one event sink), so every rule
of the single-group manager (chunked prompts, window release, copy-on-write, sealing, swapping) holds per group. A
sequence is allocated here once; each group holds a *shadow* of it (``group_shadow``: its id and token array, with
the group added to block 0's keys), so the same tokens in two groups, different layers' K/V, are different blocks
(other hashes and bytes): the verified prefix cache never gives one group another's block.

A failed call changes nothing, in any group. Every call plans all groups first (a failing ``hash_fn`` raises
there), checks room for their sum, makes every group's eviction-policy calls in one transaction (all undone
if one raises: kvlab.blocks.policy_transaction), and only then has each group do its bookkeeping, which
cannot fail. ``fork`` makes no policy call at all. Swapping is this manager's part kvlab.blocks.hybrid_swap.

Hits: the longest prefix every group serves (kvlab.blocks.group_planning plans every group's part). Invariants:
each group's records check out on their own, the pools agree with the sum of every group's references, and
the groups of a sequence schedule the same positions.

One API with ``BlockManager`` (the one-group case): the engine drives either through the same calls. Tables
are per group (``block_tables``, ``slot_mappings``: a group's layers read its own); block moves are one list
(``append_slots``' copy-on-write pairs, ``swap_out`` / ``swap_in`` mappings, group after group): page ids are
unique across groups (one pool, one CPU pool), and a move copies its page in every layer's cache tensor, where
the other groups' layers never read that page, so every group's K/V arrives where its layers look.

KV events (``kv_events=True``, kvlab.blocks.kv_events): every group's stores and evictions, tagged with the
group (by its ``GroupSink``), in one stream ``kv_events`` whose queue is this manager's alone: the events of all
groups are delivered once this manager's outermost call has finished, never by a group's own call.
"""

import threading
from collections import Counter
from typing import Optional

from kvlab.blocks.allocations import check_sequence, check_unallocated
from kvlab.blocks.group_manager import GroupManager, HybridRecord
from kvlab.blocks.group_planning import hit_pins, plan_admissions, step_needs
from kvlab.blocks.hybrid_swap import HybridSwapping, flat_moves
from kvlab.blocks.kv_cache_groups import check_group_specs
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import admission, shared_parts
from kvlab.blocks.records import AllocStatus, PrefixCacheStats
from kvlab.blocks.sequence import (Sequence, SequenceStatus, allocation_record, copy_tokens, group_shadow,
                                   set_allocation_record, sync_shadow)
from kvlab.errors import InvariantViolation, OutOfBlocksError, SequenceStateError
from kvlab.validation import check_int

__all__ = ["HybridBlockManager"]


@serialized
class HybridBlockManager(HybridSwapping):
    def __init__(self, num_blocks: int, block_size: int = 16, *, groups, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True, hash_fn=None, eviction="lru",
                 record_events: bool = False, kv_events: bool = False):
        self.groups = check_group_specs(groups)
        windows = [spec.sliding_window for spec in self.groups if spec.sliding_window is not None]
        # One set of parts for all groups (reserving the null block if any group has a window).
        shared = shared_parts(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                              enable_prefix_caching=enable_prefix_caching,
                              sliding_window=windows[0] if windows else None, hash_fn=hash_fn, eviction=eviction,
                              record_events=record_events, kv_events=kv_events, groups=self.groups)
        self.block_size, self.num_blocks = shared.block_size, shared.num_blocks
        self.enable_prefix_caching = shared.enable_prefix_caching
        self.events, self.kv_events = shared.events, shared.kv_events
        self._kv_queue = self.kv_events.queue if kv_events else ()  # delivered after each call (locking.py)
        self._pool, self._swap = shared.pool, shared.swap
        self._usable, self._watermark_blocks = shared.usable, shared.watermark_blocks
        self._members = [GroupManager(shared, spec, g) for g, spec in enumerate(self.groups)]
        self._lock = threading.RLock()

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks a prefix lookup of any group can hit now (the groups share one pool)."""
        return len(self._pool.index.cached)

    @property
    def usable_blocks(self) -> int:
        return self._usable - self._watermark_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        """``allocate``'s lookups: every group counts the same hits (cut to the hit all groups serve)."""
        return self._members[0].stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self._members[0].make_prefix_cache_stats()

    def blocks_for_prompt(self, num_tokens: int, num_new_tokens: Optional[int] = None) -> int:
        """Every group's blocks together (see BlockManager.blocks_for_prompt): ``can_allocate`` sums them."""
        return sum(member.blocks_for_prompt(num_tokens, num_new_tokens) for member in self._members)

    def ref_count(self, block_id: int) -> int:
        return self._members[0].ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self._members[0].is_cached(block_id)

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """Each group's block table (CPU ids while swapped; the null block 0 where a window released it)."""
        return [member.get_block_table(shadow) for member, shadow in zip(self._members, self._shadows(seq))]

    def slot_mappings(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """Each group's slots for positions start..end-1 (-1 where its window released the block)."""
        return [member.slot_mapping(shadow, start, end) for member, shadow in zip(self._members, self._shadows(seq))]

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Every group's table, group after group: each block the sequence holds (and a window's null blocks)."""
        return [block for table in self.block_tables(seq) for block in table]

    def take_tier_moves(self) -> list:
        """[]: a hybrid manager has no offload tier (see BlockManager.take_tier_moves)."""
        return []

    def num_scheduled_tokens(self, seq: Sequence) -> int:
        self._shadows(seq)  # allocated here
        return seq.num_computed_tokens

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens an ``allocate`` now would take from the prefix cache: the hit every group serves."""
        check_unallocated(self, seq)
        return plan_admissions(self._members, self._new_shadows(seq), 0, None)[0] * self.block_size

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None) -> AllocStatus:
        """Whether ``allocate`` fits, with every group's blocks counted (see BlockManager.can_allocate)."""
        check_unallocated(self, seq)
        lookahead = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        _, plans = plan_admissions(self._members, self._new_shadows(seq), lookahead, num_new_tokens)
        return self._admission(sum(p.peak_blocks for p in plans), hit_pins(self._pool, plans)[2])

    def allocate(self, seq: Sequence, *, num_new_tokens: Optional[int] = None) -> None:
        """Allocate ``seq`` in every group, sharing the longest prefix every group has cached."""
        check_unallocated(self, seq)
        shadows = self._new_shadows(seq)
        common, plans = plan_admissions(self._members, shadows, 0, num_new_tokens)
        pool = self._pool
        pins, revived, needed = hit_pins(self._pool, plans)
        if needed > pool.num_free or sum(p.peak_blocks for p in plans) > self._usable:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks across "
                                   f"{len(plans)} groups, {pool.num_free} are free (check can_allocate first)")
        # Out-of-window hits that nobody holds go back to the free set, still cached, once the groups hold theirs.
        unpinned = [block for plan in plans for block in plan.hits[:plan.first_live] if not pool.ref[block]]
        with pool.transaction() as txn:
            txn.revive(revived)
            new_blocks = []
            for plan in plans:
                new_blocks.append(txn.pop(plan.num_new))
                txn.hits(plan.hits)
            txn.add(unpinned, [pool.index.is_cached(block) for block in unpinned])
        pool.claim(pins, len(revived))
        for member, shadow, plan, blocks in zip(self._members, shadows, plans, new_blocks):
            member.admit(shadow, plan, blocks)
        pool.drop(pins, unpinned)  # the groups hold their live hits now
        set_allocation_record(seq, HybridRecord(self, shadows))
        seq.status, seq.num_cached_tokens = SequenceStatus.RUNNING, common * self.block_size
        seq.num_computed_tokens, seq.prefill_end = shadows[0].num_computed_tokens, seq.num_tokens

    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                         num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> bool:
        steps = self._steps(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        return sum(step_needs(steps)) <= self._pool.num_free

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> list[tuple[int, int]]:
        """Schedule a step in every group (drafts: kvlab.blocks.drafts); returns every group's copy-on-write
        (src, dst) pairs in one list, group after group (see "Block moves" above)."""
        steps = self._steps(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        needs, pool = step_needs(steps), self._pool
        if sum(needs) > pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {sum(needs)} more free blocks across its groups, "
                                   f"{pool.num_free} are free (check can_append_slots first)")
        seals = [member.hashes_to_seal(step) for member, step in zip(self._members, steps)]
        # Groups that release more than they take go first: then each group finds room when its turn comes.
        order = sorted(range(len(steps)), key=needs.__getitem__)
        taken = [None] * len(steps)
        with pool.transaction() as txn:
            for g in order:
                plan = steps[g][1]
                txn.add(plan.freed, plan.freed_cached)
                taken[g] = txn.pop(plan.blocks_needed)
        pairs = [None] * len(steps)
        for g in order:
            pairs[g] = self._members[g].apply_step(steps[g], num_lookahead_slots, taken[g], seals[g])
        seq.num_computed_tokens = steps[0][0].seq.num_computed_tokens  # every group scheduled the same positions
        seq.num_draft_tokens = num_draft_tokens
        return flat_moves(pairs)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """Verify ``seq``'s drafts in every group (see kvlab.blocks.drafts): every group checks and hashes
        before any group changes."""
        shadows = self._gpu_shadows(seq)
        plans = [member.plan_accept(shadow, num_accepted) for member, shadow in zip(self._members, shadows)]
        for member, plan in zip(self._members, plans):
            member.accept(plan)
        seq.num_computed_tokens, seq.num_draft_tokens = shadows[0].num_computed_tokens, 0

    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        releases = [member.plan_release(shadow) for member, shadow in zip(self._members, self._shadows(seq))]
        with self._pool.transaction() as txn:
            for _, _, freed, cached in releases:
                txn.add(freed, cached)
        for member, (alloc, live, freed, _) in zip(self._members, releases):
            member.release(alloc, live, freed, preempted)
        set_allocation_record(seq, None)
        seq.num_computed_tokens = seq.prefill_end = seq.num_draft_tokens = 0
        seq.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
        if preempted:
            seq.num_cached_tokens = 0
            seq.num_preemptions += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every group's blocks with the new ``child`` (see BlockManager.fork)."""
        shadows = self._gpu_shadows(parent)
        check_unallocated(self, child, need_tokens=False, same_block_size=False)
        child.block_size = parent.block_size
        copy_tokens(parent, child)
        twins = [Sequence((), parent.block_size) for _ in shadows]
        for member, shadow, twin in zip(self._members, shadows, twins):
            member.fork(shadow, twin)  # the twin takes the group's keys from the parent's shadow
            sync_shadow(child, twin)
        set_allocation_record(child, HybridRecord(self, twins))
        child.status, child.num_cached_tokens = SequenceStatus.RUNNING, parent.num_cached_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every group's cached prefixes (they live in the one shared pool) and reset every group's stats;
        False while a block is in use."""
        if not self._members[0].reset_prefix_cache():
            return False
        for member in self._members[1:]:
            member.stats = PrefixCacheStats()
        return True

    def check_invariants(self) -> None:
        """Every group's records, then the shared pools against all groups' references (O(pool); for tests)."""
        gpu_refs, cpu_refs = Counter(), Counter()
        for member in self._members:
            gpu, cpu = member.check_records()
            gpu_refs.update(gpu)
            cpu_refs.update(cpu)
        counts = Counter(member.num_sequences for member in self._members)
        if len(counts) > 1:
            raise InvariantViolation(f"the groups hold different numbers of sequences: {counts}")
        self._pool.check(gpu_refs)
        self._swap.check(cpu_refs, self._pool.ref)

    # ---- internals ---------------------------------------------------------------------------------------
    def _admission(self, live_blocks, needed_free) -> AllocStatus:
        return admission(self._pool, self._usable, self._watermark_blocks, live_blocks, needed_free)

    def _new_shadows(self, seq):
        return [group_shadow(seq, g) for g in range(len(self._members))]

    def _shadows(self, seq) -> list:
        record = allocation_record(check_sequence(seq))
        if not isinstance(record, HybridRecord) or record.manager is not self:
            raise SequenceStateError(f"sequence {seq.seq_id} is not allocated in this manager (never allocated, "
                                     "already freed, or allocated in another manager)")
        for shadow in record.shadows:
            sync_shadow(seq, shadow)
        return record.shadows

    def _gpu_shadows(self, seq) -> list:
        shadows = self._shadows(seq)
        self._members[0].gpu_record(shadows[0])  # all groups move together: group 0 tells where
        return shadows

    def _steps(self, seq, lookahead, num_new_tokens, num_drafts):
        """Each group's planned step: (record, StepPlan, num_drafts)."""
        return [member.plan_step(shadow, lookahead, num_new_tokens, num_drafts)
                for member, shadow in zip(self._members, self._gpu_shadows(seq))]
