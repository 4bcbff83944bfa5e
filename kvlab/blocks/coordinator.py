"""The coordinator (vLLM V1's ``KVCacheCoordinator``): each lifecycle call, written once, over KV cache groups.

``BlockManager`` (kvlab.blocks.manager) and ``HybridBlockManager`` (kvlab.blocks.hybrid_manager) both are a
``Coordinator``: ``allocate``, ``append_slots``, ``accept_drafts``, ``free``, ``fork``, ``reset_prefix_cache``,
``take_tier_moves`` and ``check_invariants`` (and, in kvlab.blocks.manager_swap, ``swap_out`` / ``swap_in``;
in kvlab.blocks.coordinator_queries, the queries) are implemented here and nowhere else. A ``BlockManager`` is
the one-group case: its one group is itself (``GroupManager(self)``) and its sequences are their own group's
view. A hybrid manager has one group per KV cache group, each seeing a sequence through a *shadow*
(kvlab.blocks.sequence.group_shadow) that carries the group's record and counters.

Every call runs in two phases, so a failed call changes nothing in any group: it plans every group (checks,
hashes: a failing ``hash_fn`` raises here), checks room for all of them, makes EVERY group's eviction-policy
calls in one transaction (undone whole if one raises: kvlab.blocks.policy_transaction), and only then has
each group do its bookkeeping, which cannot fail (kvlab.blocks.group_manager offers each call's two halves).

What a coordinator provides besides its groups (``_members``) and the shared parts (``_pool``, ``_swap``,
``_sink``, ``_usable``, ``_watermark_blocks``, ``block_size``): ``_views(seq)`` (each group's view of an allocated
sequence), ``_gpu_views(seq)`` (the same, checked to be on the GPU), ``_new_views(seq)`` (of a sequence to
allocate), ``_fork_views(child)``, and the encoder-decoder tables' hooks (one group only: kvlab.blocks.vllm_v0)
``_cross_blocks(seq, encoder_seq)``, ``_attach_cross(seq, encoder_seq, blocks)`` and ``_cross_tables()``. Where
the views are shadows, the sequence's own record and counters follow group 0's shadow
(``_follow_views``): all groups schedule the same positions.
"""

from collections import Counter
from typing import Optional

from kvlab.blocks.allocations import check_unallocated
from kvlab.blocks.coordinator_queries import CoordinatorQueries
from kvlab.blocks.group_manager import HybridRecord
from kvlab.blocks.group_planning import free_blocks_needed, hit_pins, plan_admissions, step_needs
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import admission
from kvlab.blocks.manager_swap import Swapping, flat_moves
from kvlab.blocks.records import AllocStatus
from kvlab.blocks.sequence import Sequence, SequenceStatus, copy_tokens, set_allocation_record, sync_shadow
from kvlab.errors import InvariantViolation, OutOfBlocksError
from kvlab.validation import check_int


@serialized
class Coordinator(CoordinatorQueries, Swapping):
    # ---- admission and allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead_slots: int = 0, encoder_seq=None, *,
                     num_new_tokens: Optional[int] = None) -> AllocStatus:
        """Whether ``allocate(seq, encoder_seq, num_new_tokens=...)`` (plus ``num_lookahead_slots`` later) fits,
        every group's blocks counted. A prefix hit on a block in use costs nothing; a hit on a free cached block
        takes that block out of the free pool. OK and LATER are about this step (keeping the watermark free);
        NEVER says the prompt can never be finished here, however it is chunked (without a sliding window: its
        whole prompt never fits)."""
        check_unallocated(self, seq)
        lookahead = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        cross = self._cross_blocks(seq, encoder_seq)
        _, plans = plan_admissions(self._members, self._new_views(seq), lookahead, num_new_tokens)
        return self._admission(sum(plan.peak_blocks for plan in plans) + cross,
                               free_blocks_needed(self._pool, plans) + cross)

    def allocate(self, seq: Sequence, encoder_seq: Optional[Sequence] = None, *,
                 num_new_tokens: Optional[int] = None) -> None:
        """Give the prompt its blocks in every group, sharing the longest prefix every group has cached; with
        ``encoder_seq`` (an encoder-decoder request, one group only) also a cross-attention table for the
        encoder's tokens, shared by the sequence's future forks. With ``num_new_tokens=k`` only the hits and
        the next k prompt tokens get slots (the first chunk; ``get_num_cached_tokens`` tells the hits
        beforehand), and ``append_slots`` schedules the rest later. Only full blocks are hittable, never the
        one holding the last prompt token (always computed): at most (n - 1) // block_size of an n-token
        prompt's blocks. Atomic: raises before changing anything if the blocks are not there, or if the prompt
        could never be finished in this pool."""
        check_unallocated(self, seq)
        num_cross = self._cross_blocks(seq, encoder_seq)
        views = self._new_views(seq)
        _, plans = plan_admissions(self._members, views, 0, num_new_tokens)
        pool, several = self._pool, len(plans) > 1
        pins, revived, needed = hit_pins(pool, plans)
        self._check_room(seq, needed + num_cross, sum(plan.peak_blocks for plan in plans) + num_cross, len(plans))
        # Out-of-window hits that nobody holds go back to the free set, still cached, once the groups hold theirs
        # (pinned only where there are several groups: see group_planning.hit_pins).
        unpinned = [block for plan in plans for block in plan.hits[:plan.first_live] if not pool.ref[block]] \
            if several else ()
        with pool.transaction() as txn:  # every group's policy calls first: if one raises, nothing changed
            txn.revive(revived)
            taken = []
            for plan in plans:  # the encoder's table comes with the first group's blocks (one group has one)
                taken.append(txn.pop(plan.num_new + (num_cross if not taken else 0)))
                txn.hits(plan.hits)
            if unpinned:
                txn.add(unpinned, [pool.index.is_cached(block) for block in unpinned])
        if several:  # pinned while the groups take their blocks: see group_planning.hit_pins
            pool.claim(pins, len(revived))
        cross_blocks = taken[0][plans[0].num_new:] if num_cross else ()
        if num_cross:
            taken[0] = taken[0][:plans[0].num_new]
        for member, view, plan, blocks in zip(self._members, views, plans, taken):
            member.admit(view, plan, blocks, 0 if several else len(revived), cross_blocks)
        self._attach_cross(seq, encoder_seq, cross_blocks)
        if several:
            pool.drop(pins, unpinned)  # the groups hold their live hits now
        self._follow_views(seq, views, adopted=True)

    def _check_room(self, seq, needed_free: int, peak_blocks: int, num_groups: int) -> None:
        pool = self._pool
        across = f" across {num_groups} groups" if num_groups > 1 else ""
        if needed_free > pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed_free} free blocks{across}, "
                                   f"{pool.num_free} are free (check can_allocate first)")
        if peak_blocks > self._usable:  # a first chunk that fits, of a prompt that never can
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {peak_blocks} blocks at once{across} to finish "
                                   f"its prompt, the pool has {self._usable} (check can_allocate first)")

    # ---- a step's growth and its verification ------------------------------------------------------------
    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                         num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> bool:
        """Whether ``append_slots`` with the same arguments fits now (a running sequence: no watermark)."""
        steps = self._steps(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        return sum(step_needs(steps)) <= self._pool.num_free

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> list[tuple[int, int]]:
        """Schedule a step in every group: release the blocks that left a sliding window, give slots to the
        next ``num_new_tokens`` tokens that have none (None: all of them, i.e. every token appended by
        ``seq.append_token`` since the last step, or the rest of a chunked prompt), then to
        ``num_draft_tokens`` proposed tokens after the last one (verified by this step's forward pass, then
        ``accept_drafts``: kvlab.blocks.drafts) and to ``num_lookahead_slots`` more, and seal blocks whose last
        token is now scheduled, drafts aside (they become hittable at once: the ordering rule,
        kvlab.blocks.manager). A shared block about to be written is copied first; returns those copy-on-write
        (src, dst) pairs for ``copy_blocks``, every group's in one list, group after group."""
        steps = self._steps(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        needs, pool = step_needs(steps), self._pool
        if sum(needs) > pool.num_free:  # the blocks the step releases count as free
            across = " across its groups" if len(steps) > 1 else ""
            needed = sum(plan.blocks_needed for _, plan, _ in steps)
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks{across}, "
                                   f"{pool.num_free + needed - sum(needs)} are free (check can_append_slots first)")
        seals = [member.hashes_to_seal(step) for member, step in zip(self._members, steps)]
        # Groups that release more than they take go first: then each group finds room when its turn comes.
        order = sorted(range(len(steps)), key=needs.__getitem__) if len(steps) > 1 else (0,)
        taken = [None] * len(steps)
        with pool.transaction() as txn:
            for g in order:
                plan = steps[g][1]
                txn.add(plan.freed, plan.freed_cached)
                taken[g] = txn.pop(plan.blocks_needed)
        pairs = [None] * len(steps)
        for g in order:
            pairs[g] = self._members[g].apply_step(steps[g], num_lookahead_slots, taken[g], seals[g])
        self._follow_views(seq, [steps[0][0].seq])  # every group scheduled the same positions
        return flat_moves(pairs)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """The step that scheduled ``seq``'s draft tokens ran, and its first ``num_accepted`` drafts were
        accepted (0: all rejected); append those tokens (``seq.append_token``) first. Their K/V stays where the
        pass wrote it, the blocks they complete are sealed (hittable), and ``seq.num_computed_tokens`` rolls
        back past the rejected ones, whose slots the next step overwrites (kvlab.blocks.drafts). Every group
        checks and hashes before any group changes."""
        views = self._gpu_views(seq)
        plans = [member.plan_accept(view, num_accepted) for member, view in zip(self._members, views)]
        for member, plan in zip(self._members, plans):
            member.accept(plan)
        self._follow_views(seq, views)

    # ---- free and fork -----------------------------------------------------------------------------------
    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        """Drop the sequence's references in every group, tail block first (so LRU reuses the chain's tail
        first). Status becomes FINISHED, or WAITING with ``preempted=True`` (to be recomputed later). A
        cross-attention table stays with its group until ``free_cross``."""
        releases = [member.plan_release(view) for member, view in zip(self._members, self._views(seq))]
        with self._pool.transaction() as txn:
            for _, _, freed, cached in releases:
                txn.add(freed, cached)
        for member, (alloc, live, freed, _) in zip(self._members, releases):
            member.release(alloc, live, freed, preempted)
        if releases[0][0].seq is not seq:  # shadows: the sequence's own record and counters go too
            set_allocation_record(seq, None)
            seq.num_computed_tokens = seq.prefill_end = seq.num_draft_tokens = 0
            seq.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
            if preempted:
                seq.num_cached_tokens = 0
                seq.num_preemptions += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give the new ``child`` the parent's tokens (and block size, salt and keys) and share all its blocks,
        in every group: nothing is allocated; a later append into a shared partial block copies it. Whatever
        tokens and keys the child had are replaced (``Sequence([])`` is the usual child). A parent's drafts in
        flight are the child's too, and each verifies them on its own (kvlab.blocks.drafts)."""
        views = self._gpu_views(parent)
        check_unallocated(self, child, need_tokens=False, same_block_size=False)
        child.block_size = parent.block_size
        twins = self._fork_views(child, len(views))
        for member, view, twin in zip(self._members, views, twins):
            member.fork(view, twin)  # the twin takes the view's tokens, keys and counters
        if twins[0] is not child:  # shadows: the child gets the parent's tokens and a record of them all
            copy_tokens(parent, child)
            for twin in twins:
                sync_shadow(child, twin)
            self._follow_views(child, twins, adopted=True)

    # ---- maintenance -------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (every group's: they live in the one pool; the offload tier's too) and
        reset every group's stats; refused (False) while any GPU block is in use."""
        pool = self._pool
        if pool.num_free != self._usable:
            return False
        free = list(pool.policy)
        with pool.transaction() as txn:
            txn.revive(free)
            txn.add(free, [False] * len(free))
        pool.index.forget_all()
        if pool.tier is not None:
            pool.tier.clear()
        if self._sink is not None:
            self._sink.cleared()
        pool.evictions = 0
        for member in self._members:
            member.reset_stats()
        return True

    def take_tier_moves(self) -> list[tuple[str, int, int]]:
        """The offload tier's copies made since the last call, in order: ``("offload", gpu_block, cpu_slot)``
        (an evicted cached block kept in the tier) and ``("promote", cpu_slot, gpu_block)`` (a tier hit brought
        back by ``allocate``). Apply them in this order, before the moves the same calls returned (copy-on-write
        pairs, swap mappings) and before the step's forward pass ([] without a tier: a hybrid manager has none)."""
        return self._pool.tier.take_moves() if self._pool.tier is not None else []

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the bookkeeping is inconsistent: every group's records on their own, then
        the shared pools (and the offload tier) against all groups' references together (O(pool); for tests)."""
        gpu_refs, cpu_refs = Counter(), Counter()
        for member in self._members:
            gpu, cpu = member.check_records(self._cross_tables())  # the tables are a one-group manager's
            gpu_refs.update(gpu)
            cpu_refs.update(cpu)
        counts = Counter(member.num_sequences for member in self._members)
        if len(counts) > 1:
            raise InvariantViolation(f"the groups hold different numbers of sequences: {counts}")
        pool = self._pool
        pool.check(gpu_refs)
        self._swap.check(cpu_refs, pool.ref)
        if pool.tier is not None:
            pool.tier.check(pool.index)

    # ---- internals -----------------------------------------------------------------------------------------
    def _admission(self, live_blocks, needed_free) -> AllocStatus:
        """``live_blocks`` held at once, ``needed_free`` of them taken from the free pool now."""
        return admission(self._pool, self._usable, self._watermark_blocks, live_blocks, needed_free)

    def _steps(self, seq, lookahead, num_new_tokens, num_drafts):
        """Each group's planned step: (record, StepPlan, num_drafts)."""
        return [member.plan_step(view, lookahead, num_new_tokens, num_drafts)
                for member, view in zip(self._members, self._views(seq))]

    def _follow_views(self, seq, views, adopted: bool = False) -> None:
        """Where ``views`` are shadows, bring ``seq``'s counters up to group 0's (every group schedules the same
        positions); ``adopted``: it was just allocated or forked, and its record holds every shadow."""
        first = views[0]
        if first is seq:
            return
        if adopted:
            set_allocation_record(seq, HybridRecord(self, views))
            seq.status, seq.num_cached_tokens = first.status, first.num_cached_tokens
            seq.prefill_end = first.prefill_end
        seq.num_computed_tokens, seq.num_draft_tokens = first.num_computed_tokens, first.num_draft_tokens
