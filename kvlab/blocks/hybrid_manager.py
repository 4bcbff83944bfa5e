"""HybridBlockManager: KV cache groups (vLLM V1's hybrid allocator, ``HybridKVCacheCoordinator``).

A model mixing layer kinds has one group per kind (``kvlab.blocks.kv_cache_groups``); each group keeps its own
block table per sequence and all groups draw from ONE pool of equal-size pages.

Design. Each group is a ``BlockManager`` of its own (``GroupManager``, windowed as its spec says), so every
rule of the single-group manager (chunked prompts, window release, copy-on-write, sealing, swapping) holds per
group, and ``BlockManager``'s single-group path is untouched. A template ``BlockManager`` checks the
arguments and builds the shared ``BlockPool`` and ``SwapSpace``; the members are built small and then pointed
at them. A sequence is allocated here once; each group holds a *shadow* of it (``group_shadow``: its id and
token array, with the group added to block 0's keys), so the same tokens in two groups, different layers'
K/V, are different blocks (other hashes and bytes): the verified prefix cache never gives one group
another's block.

Hits (vLLM's ``find_longest_cache_hit``): the hit is the longest prefix every group serves. kvlab's lookup
is prefix-closed in every group (a hit's chain is verified from block 0; a window group's out-of-window hits
are proved but not pinned), so that is the minimum over groups, and vLLM's fixed-point iteration ends in one
pass. vLLM's SlidingWindowManager is more generous: it scans right to left and needs only the blocks under
the window cached, so kvlab misses hits whose early blocks were evicted.

Invariants: each group's records check out on their own, the pools agree with the sum of every group's
references, and the groups of a sequence schedule the same positions. Every operation plans all groups and
checks room for their sum before any group acts; allocate pins every group's hits meanwhile, so one group's
new blocks never evict another's planned hit.

KV events (``kv_events=True``, kvlab.blocks.kv_events): every group's stores and evictions, tagged with the
group, in one stream ``kv_events``. The members report to the shared sink through a ``GroupSink`` that adds
their group; the queue belongs to this manager alone (the template and the members have none), so the events
of all groups are delivered once this manager's outermost call has finished, never by a member's own call.

Limitation: "a call that fails changes nothing" holds per group, not across groups. Each group's operation is
undone if it fails, but when a user eviction policy or ``hash_fn`` raises in group g of ``allocate``,
``append_slots``, ``free``, ``fork``, ``swap_out`` or ``swap_in``, groups 0..g-1 keep their part done (and
``allocate`` keeps its pins), so the sequence's groups disagree and ``check_invariants`` says so.
"""

import threading
from collections import Counter
from typing import Optional

from kvlab.blocks.allocations import check_sequence, check_unallocated
from kvlab.blocks.event_sink import GroupSink, make_sink
from kvlab.blocks.hashing import prompt_blocks
from kvlab.blocks.invariants import check_records
from kvlab.blocks.kv_cache_groups import check_group_specs
from kvlab.blocks.kv_events import KVEventPublisher
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager import BlockManager
from kvlab.blocks.planning import plan_allocation
from kvlab.blocks.records import AllocStatus
from kvlab.blocks.sequence import (Sequence, SequenceStatus, allocation_record, copy_tokens, group_shadow,
                                   set_allocation_record, sync_shadow)
from kvlab.errors import InvariantViolation, OutOfBlocksError, SequenceStateError
from kvlab.validation import check_int

__all__ = ["HybridBlockManager"]


class GroupManager(BlockManager):
    """One group: a BlockManager whose prefix hits the coordinator cuts to ``max_hits`` blocks."""
    max_hits: Optional[int] = None

    def _plan_allocation(self, seq, lookahead, num_new_tokens):
        hashes, contents = prompt_blocks(seq, self.block_size, self.hash_fn) if self.enable_prefix_caching else ([], [])
        return plan_allocation(self._pool, seq, hashes, contents, self.block_size, self.sliding_window, lookahead,
                               num_new_tokens, self.max_hits)


class HybridRecord:
    """``allocation_record(seq)`` of a sequence allocated here: its shadow in each group."""
    __slots__ = ("manager", "shadows")

    def __init__(self, manager, shadows):
        self.manager, self.shadows = manager, shadows

    @property
    def table(self):  # Sequence.block_table shows group 0's; block_tables(seq) has them all
        return allocation_record(self.shadows[0]).table


@serialized
class HybridBlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, *, groups, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True, hash_fn=None, eviction="lru",
                 record_events: bool = False, kv_events: bool = False):
        self.groups = check_group_specs(groups)
        windows = [spec.sliding_window for spec in self.groups if spec.sliding_window is not None]
        # The template owns the shared pool (reserving the null block if any group has a window).
        base = self._base = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                         watermark=watermark, enable_prefix_caching=enable_prefix_caching,
                                         sliding_window=windows[0] if windows else None, hash_fn=hash_fn,
                                         eviction=eviction, record_events=record_events)
        self.block_size, self.num_blocks, self.events = base.block_size, base.num_blocks, base.events
        self._pool, self._swap = base._pool, base._swap
        # The publisher is this manager's, not the template's: a template call (reset_prefix_cache) would
        # otherwise deliver the queue in the middle of this manager's call (kvlab.blocks.locking).
        self.kv_events = KVEventPublisher(base.block_size, self.groups) if kv_events else None
        self._kv_queue = self.kv_events.queue if kv_events else ()
        sink = base._sink = base._pool.sink = make_sink(base._sink, self.kv_events)
        self._members = []
        for g, spec in enumerate(self.groups):
            member = GroupManager(2, block_size, enable_prefix_caching=enable_prefix_caching,
                                  sliding_window=spec.sliding_window, hash_fn=hash_fn)
            member.num_blocks, member._pool, member._swap = base.num_blocks, base._pool, base._swap
            member._sink = None if sink is None else GroupSink(sink, g)
            member._usable, member._watermark_blocks = base._usable, base._watermark_blocks
            self._members.append(member)
        self._lock = threading.RLock()

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def usable_blocks(self) -> int:
        return self._base.usable_blocks

    def blocks_for_prompt(self, num_tokens: int, num_new_tokens: Optional[int] = None) -> int:
        """Every group's blocks together (see BlockManager.blocks_for_prompt): ``can_allocate`` sums them."""
        return sum(member.blocks_for_prompt(num_tokens, num_new_tokens) for member in self._members)

    def ref_count(self, block_id: int) -> int:
        return self._base.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self._base.is_cached(block_id)

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """Each group's block table (CPU ids while swapped; the null block 0 where a window released it)."""
        return [member.get_block_table(shadow) for member, shadow in zip(self._members, self._shadows(seq))]

    def slot_mappings(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """Each group's slots for positions start..end-1 (-1 where its window released the block)."""
        return [member.slot_mapping(shadow, start, end) for member, shadow in zip(self._members, self._shadows(seq))]

    def num_scheduled_tokens(self, seq: Sequence) -> int:
        self._shadows(seq)  # allocated here
        return seq.num_computed_tokens

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens an ``allocate`` now would take from the prefix cache: the hit every group serves."""
        check_unallocated(self, seq)
        return self._plans(self._new_shadows(seq), 0, None)[0] * self.block_size

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None) -> AllocStatus:
        """Whether ``allocate`` fits, with every group's blocks counted (see BlockManager.can_allocate)."""
        check_unallocated(self, seq)
        lookahead = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        _, plans = self._plans(self._new_shadows(seq), lookahead, num_new_tokens)
        return self._base._admission(sum(p.peak_blocks for p in plans), self._pins(plans)[2])

    def allocate(self, seq: Sequence, *, num_new_tokens: Optional[int] = None) -> None:
        """Allocate ``seq`` in every group, sharing the longest prefix every group has cached."""
        check_unallocated(self, seq)
        shadows = self._new_shadows(seq)
        common, plans = self._plans(shadows, 0, num_new_tokens)
        pool = self._pool
        pins, revived, needed = self._pins(plans)
        if needed > pool.num_free or sum(p.peak_blocks for p in plans) > self._base._usable:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks across "
                                   f"{len(plans)} groups, {pool.num_free} are free (check can_allocate first)")
        with pool.transaction() as txn:
            txn.revive(revived)
        pool.claim(pins, len(revived))
        for member, shadow in zip(self._members, shadows):
            member.allocate(shadow, num_new_tokens=num_new_tokens)
        pool.release(pins)  # the groups hold their live hits now; out-of-window hits go back, still cached
        set_allocation_record(seq, HybridRecord(self, shadows))
        seq.status, seq.num_cached_tokens = SequenceStatus.RUNNING, common * self.block_size
        seq.num_computed_tokens, seq.prefill_end = shadows[0].num_computed_tokens, seq.num_tokens

    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                         num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> bool:
        return sum(self._step_needs(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)[1]) <= \
            self._pool.num_free

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> list[list[tuple[int, int]]]:
        """Schedule a step in every group (drafts: kvlab.blocks.drafts); returns each group's copy-on-write
        (src, dst) pairs."""
        shadows, needs = self._step_needs(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        if sum(needs) > self._pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {sum(needs)} more free blocks across its groups, "
                                   f"{self._pool.num_free} are free (check can_append_slots first)")
        # Groups that release more than they take go first: then each group finds room when its turn comes.
        pairs = [None] * len(shadows)
        for g in sorted(range(len(shadows)), key=needs.__getitem__):
            pairs[g] = self._members[g].append_slots(shadows[g], num_lookahead_slots, num_new_tokens=num_new_tokens,
                                                     num_draft_tokens=num_draft_tokens)
        seq.num_computed_tokens = shadows[0].num_computed_tokens  # every group scheduled the same positions
        seq.num_draft_tokens = num_draft_tokens
        return pairs

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """Verify ``seq``'s drafts in every group (see kvlab.blocks.drafts); group 0 refuses bad arguments
        before any group changes."""
        shadows = self._gpu_shadows(seq)
        for member, shadow in zip(self._members, shadows):
            member.accept_drafts(shadow, num_accepted)
        seq.num_computed_tokens, seq.num_draft_tokens = shadows[0].num_computed_tokens, 0

    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        for member, shadow in zip(self._members, self._shadows(seq)):
            member.free(shadow, preempted=preempted)
        set_allocation_record(seq, None)
        seq.num_computed_tokens = seq.prefill_end = seq.num_draft_tokens = 0
        seq.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
        if preempted:
            seq.num_cached_tokens = 0

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
        """Forget every group's cached prefixes (they live in the one shared pool); False while a block is in use."""
        return self._base.reset_prefix_cache()

    # ---- swapping ----------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> AllocStatus:
        needed = self._swap_out_needs(self._gpu_shadows(seq))
        if needed > self._swap.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if needed <= self._swap.num_free else AllocStatus.LATER

    def swap_out(self, seq: Sequence) -> list[list[tuple[int, int]]]:
        """Move every group's blocks to the CPU pool; returns each group's (gpu, cpu) copies."""
        shadows = self._gpu_shadows(seq)
        if self._swap_out_needs(shadows) > self._swap.num_free:
            raise OutOfBlocksError(f"not enough free CPU blocks to swap out sequence {seq.seq_id}")
        mappings = [member.swap_out(shadow) for member, shadow in zip(self._members, shadows)]
        seq.status = SequenceStatus.SWAPPED
        return mappings

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        return self._base._admission(*map(sum, zip(*self._swap_in_needs(seq))))

    def swap_in(self, seq: Sequence) -> list[list[tuple[int, int]]]:
        """Bring every group's blocks back; returns each group's (cpu, gpu) copies."""
        if self.can_swap_in(seq) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        mappings = [member.swap_in(shadow) for member, shadow in zip(self._members, self._shadows(seq))]
        seq.status = SequenceStatus.RUNNING
        return mappings

    def check_invariants(self) -> None:
        """Every group's records, then the shared pools against all groups' references (O(pool); for tests)."""
        gpu_refs, cpu_refs = Counter(), Counter()
        for member in self._members:
            gpu, cpu = check_records(member._allocs, member._cross, self._pool, self.block_size,
                                     member.enable_prefix_caching)
            gpu_refs.update(gpu)
            cpu_refs.update(cpu)
            for alloc in member._allocs:
                record = allocation_record(alloc.seq)  # the shadow's; the sequence's own is checked below
                if record is not alloc:
                    raise InvariantViolation(f"a shadow of sequence {alloc.seq.seq_id} lost its record")
        counts = Counter(len(member._allocs) for member in self._members)
        if len(counts) > 1:
            raise InvariantViolation(f"the groups hold different numbers of sequences: {counts}")
        self._pool.check(gpu_refs)
        self._swap.check(cpu_refs, self._pool.ref)

    # ---- internals ---------------------------------------------------------------------------------------
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
        self._members[0]._on_gpu(shadows[0])  # all groups move together: group 0 tells where
        return shadows

    def _plans(self, shadows, lookahead, num_new_tokens):
        """(common hit in blocks, each group's plan with its hits cut to it)."""
        common = None
        for member, shadow in zip(self._members, shadows):
            member.max_hits = common
            common = len(member._plan_allocation(shadow, lookahead, None).hits)
        for member in self._members:
            member.max_hits = common
        return common, [member._plan_allocation(shadow, lookahead, num_new_tokens)
                        for member, shadow in zip(self._members, shadows)]

    def _pins(self, plans):
        """(every group's hits, the free ones among them, the free blocks allocate takes). All hits are pinned
        while the groups allocate, a window group's out-of-window ones too: were one evicted by another group's
        new blocks, that group's lookup would find a shorter hit than the plan. So can_allocate counts them."""
        pins = [block for plan in plans for block in plan.hits]
        revived = [block for block in pins if not self._pool.ref[block]]
        fresh = sum(plan.live_blocks - len(plan.hits) + plan.first_live for plan in plans)
        return pins, revived, fresh + len(revived)

    def _step_needs(self, seq, lookahead, num_new_tokens, num_drafts):
        shadows = self._gpu_shadows(seq)
        plans = [member._plan_step(member._on_gpu(shadow), lookahead, num_new_tokens, num_drafts)
                 for member, shadow in zip(self._members, shadows)]
        return shadows, [plan.blocks_needed - len(plan.freed) for plan in plans]

    def _swap_out_needs(self, shadows) -> int:
        return sum(self._swap.blocks_needed_out(member._on_gpu(shadow).live_blocks())
                   for member, shadow in zip(self._members, shadows))

    def _swap_in_needs(self, seq):
        return [self._swap.blocks_needed_in(member._on_cpu(shadow))
                for member, shadow in zip(self._members, self._shadows(seq))]
