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
today's whole-prompt and decode behaviour). How far the sequence got is its own ``seq.num_computed_tokens``:
these calls advance it, ``free`` resets it, ``check_invariants`` audits it (``num_scheduled_tokens(seq)`` reads it).

Sliding window W: a step whose first new token sits at position p attends to keys from p - W + 1 on, so a
block is released only once it lies wholly before that, at the start of the next step that moves p past it
(never while a query of the current step can still see it).

Lifecycle: ``allocate`` (RUNNING) -> ``append_token`` + ``append_slots`` per step -> ``free`` (FINISHED, or
WAITING with ``preempted=True``); ``fork`` shares a running sequence's blocks with a new child;
``swap_out`` (SWAPPED) / ``swap_in`` (RUNNING) move it to the CPU pool and back. The manager decides what is
valid from its own records, never from a status a caller set. Every public method holds one lock, so
threads may share a manager (each Sequence belongs to one thread at a time). A failed call changes nothing.

``BlockManager`` is the coordinator (kvlab.blocks.coordinator) of one KV cache group, itself: the lifecycle
calls (``allocate``, ``append_slots``, ``accept_drafts``, ``free``, ``fork``; ``swap_out`` / ``swap_in`` in
kvlab.blocks.manager_swap) are the coordinator's, written once for any number of groups, and this module holds
the group's halves of them (admission, free, fork: plan first, bookkeeping after the coordinator's policy
calls) and the maintenance. It is built from parts that each add calls over the state ``ManagerState``
creates (kvlab.blocks.manager_state, where its constructor lives): a step's halves
(kvlab.blocks.manager_steps), the queries (kvlab.blocks.manager_queries), speculative decoding's verification
(kvlab.blocks.drafts: draft tokens get slots, only verified ones are sealed) and vLLM V0's interface with the
encoder-decoder cross-attention tables (kvlab.blocks.vllm_v0). Every part reports its changes to the
manager's one event sink (kvlab.blocks.event_sink), when anything listens.
"""

from kvlab.blocks.allocations import Allocation
from kvlab.blocks.coordinator import Coordinator
from kvlab.blocks.drafts import SpeculativeDrafts, share_drafts
from kvlab.blocks.group_manager import GroupManager
from kvlab.blocks.hashing import prompt_blocks, sealed_through
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_queries import GroupQueries
from kvlab.blocks.manager_state import MAX_BLOCKS, NULL_BLOCK
from kvlab.blocks.manager_steps import BlockManagerSteps
from kvlab.blocks.planning import plan_allocation
from kvlab.blocks.prefix_index import ROOT
from kvlab.blocks.records import AllocStatus, PrefixCacheStats
from kvlab.blocks.sequence import Sequence, SequenceStatus, copy_tokens, set_allocation_record
from kvlab.blocks.vllm_v0 import VLLMV0Interface

__all__ = ["BlockManager", "AllocStatus", "PrefixCacheStats", "NULL_BLOCK", "MAX_BLOCKS"]


@serialized
class BlockManager(Coordinator, BlockManagerSteps, GroupQueries, VLLMV0Interface, SpeculativeDrafts):
    """The coordinator (kvlab.blocks.coordinator) of one KV cache group: itself. Its lifecycle calls
    (``allocate``, ``append_slots``, ``free``, ``fork``, swapping) are the coordinator's, driving this manager's
    own halves below through ``GroupManager(self)``; a sequence is its own group's view."""

    def _join(self, *args, **kwargs) -> None:
        super()._join(*args, **kwargs)
        self._members = (GroupManager(self),)

    # ---- the coordinator's views of a sequence: itself, in the one group -----------------------------------
    def _views(self, seq):
        return (seq,)

    def _gpu_views(self, seq):
        self._on_gpu(seq)
        return (seq,)

    _new_views = _views

    def _fork_views(self, child, num_groups: int):
        return (child,)

    def _cross_blocks(self, seq, encoder_seq) -> int:
        return self._cross.blocks_for(seq, encoder_seq)

    # ---- fork's half ---------------------------------------------------------------------------------------
    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """fork's bookkeeping (no policy call): ``child`` takes the parent's tokens and counters and shares its
        blocks, drafts in flight too (kvlab.blocks.drafts) and its group's cross-attention table."""
        alloc = self._on_gpu(parent)
        child.block_size = parent.block_size
        copy_tokens(parent, child)
        twin = alloc.copy_for(child)
        if parent.num_draft_tokens:
            share_drafts(alloc, twin)
        self._pool.claim(twin.live_blocks(), 0)  # all in use by the parent: none was free
        self._cross.share(alloc, twin)
        self._adopt(twin, child.num_cached_tokens)
        if self._sink is not None:
            self._sink.forked(child.seq_id, parent.seq_id)

    # ---- internals -------------------------------------------------------------------------------------
    def _adopt(self, alloc: Allocation, num_cached_tokens: int) -> None:
        self._allocs.add(alloc)
        seq = alloc.seq
        set_allocation_record(seq, alloc)
        seq.num_cached_tokens, seq.status = num_cached_tokens, SequenceStatus.RUNNING

    def _admit(self, seq, plan, new_blocks, num_revived: int, encoder_seq=None, cross_blocks=()) -> None:
        """allocate's bookkeeping, once the policy handed out ``new_blocks`` (and ``cross_blocks``) and took
        ``num_revived`` of the plan's live hits out of the free set (cannot fail): pin the live hits, seal the
        prompt's blocks this step writes, and record the sequence."""
        self._pool.claim(plan.hits[plan.first_live:], num_revived)
        if self._sink is not None:
            self._sink.looked_up(seq.seq_id, plan.hits, new_blocks)
        recomputing = seq.num_preemptions > 0  # its own blocks again: not prefix hits (PrefixCacheStats)
        if self._tier is not None:
            self._tier.looked_up(seq.num_tokens, plan.hashes, len(plan.hits), len(plan.tier_hits), self.block_size,
                                 counted=not recomputing)
        last_content = self._seal_prompt(plan, new_blocks)
        if self.enable_prefix_caching:
            sealed_through(seq, plan.num_sealed)
            self.stats.count_lookup(seq.num_tokens, len(plan.hashes), len(plan.hits), self.block_size, recomputing)
        self._pool.fill(cross_blocks)
        if self._sink is not None:
            self._sink.allocated(seq.seq_id)
        # Hits outside the sliding window prove the chain but are not pinned: the table points at the null block.
        table = [NULL_BLOCK] * plan.first_live + plan.hits[plan.first_live:] + new_blocks
        alloc = Allocation.admitted(self, seq, plan, table, last_content)
        self._cross.attach(alloc, encoder_seq, cross_blocks)
        seq.num_computed_tokens, seq.prefill_end = plan.scheduled, seq.num_tokens
        self._adopt(alloc, alloc.num_computed)

    def _plan_release(self, seq):
        """(record, its live blocks tail first, the GPU ones of them that become free, whether each is cached)."""
        alloc = self._alloc(seq)
        live = alloc.live_blocks()[::-1]
        return (alloc, live, *(((), ()) if alloc.on_cpu else self._pool.freed_by(live)))

    def _release(self, alloc, live, freed, preempted: bool) -> None:
        """free's bookkeeping, once the policy took back ``freed`` (cannot fail): drop the references to
        ``live`` (GPU or CPU blocks, tail first) and forget the sequence."""
        if alloc.on_cpu:
            self._swap.release(live)
        else:
            self._pool.drop(live, freed)
            self._swap.forget_gpu(freed)
        self._cross.detach(alloc)
        self._allocs.discard(alloc)
        seq = alloc.seq
        set_allocation_record(seq, None)
        seq.num_computed_tokens = seq.prefill_end = seq.num_draft_tokens = 0  # no slots: recomputed, it starts over
        seq.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
        if preempted:
            seq.num_cached_tokens = 0
            seq.num_preemptions += 1
        if self._sink is not None:
            self._sink.freed(seq.seq_id)

    def _seal_prompt(self, plan, new_blocks: list[int]):
        """Promote the tier hits into the first new blocks, then seal the new blocks this step writes to the end
        (they become hittable, see the ordering rule); returns the content id of the chain's tail, which the
        next seal extends."""
        pool, stop, start = self._pool, plan.num_sealed, len(plan.hits)
        parent = pool.index.content[plan.hits[-1]] if start else ROOT
        if plan.tier_hits:
            parent = self._promote(plan, new_blocks[:len(plan.tier_hits)])
            new_blocks, start = new_blocks[len(plan.tier_hits):], start + len(plan.tier_hits)
        hashes, contents = plan.hashes[start:stop], plan.contents[start:stop]
        parent = pool.fill(new_blocks, hashes, contents, parent, self.group)
        if self._sink is not None:
            self._sink.stored(pool.index, new_blocks[:stop - start], hashes, contents,
                              plan.hashes[start - 1] if start else None)
        return parent

    def _promote(self, plan, blocks: list[int]):
        """Bring the plan's tier hits into ``blocks`` (kvlab.blocks.offload_tier); returns the last one's content id."""
        parent = self._tier.promote(self._pool, plan.tier_hits, blocks)
        if self._sink is not None:
            first = len(plan.hits)
            self._sink.stored(self._pool.index, blocks, plan.hashes[first:first + len(blocks)],
                              plan.contents[first:first + len(blocks)], plan.hashes[first - 1] if first else None)
        return parent

    def _plan_allocation(self, seq, lookahead, num_new_tokens, max_hits=None):
        hashes, contents = prompt_blocks(seq, self.block_size, self.hash_fn) if self.enable_prefix_caching else ([], [])
        return plan_allocation(self._pool, seq, hashes, contents, self.block_size, self.spec, lookahead,
                               num_new_tokens, max_hits, self.group)
