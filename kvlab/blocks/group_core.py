"""One KV cache group's core: its records and the group's halves of each lifecycle call, on the shared parts.

A ``GroupCore`` is one group of attention ``spec`` (kvlab.blocks.kv_cache_groups) over the parts its coordinator's
groups share (kvlab.blocks.manager_state: the pool, the CPU pool, the event sink). It keeps the group's
``Allocation`` records and does the group's part of each call in two halves: a plan (``_plan_allocation``,
``_plan_step`` and ``_hashes_to_seal`` in kvlab.blocks.manager_steps, ``_plan_accept`` in kvlab.blocks.drafts,
``_plan_release``) and the bookkeeping once the coordinator made every group's policy calls (``_admit``,
``_apply_step``, ``_accept``, ``_release``, ``_fork``), which cannot fail. It answers the group's own questions
(its table, its slots, its hits, its stats). It is no coordinator and has no whole call: ``GroupManager``
(kvlab.blocks.group_manager) offers its halves to the coordinator (kvlab.blocks.coordinator).

A ``BlockManager`` is a ``GroupCore`` and the coordinator of that one group, itself; a ``HybridBlockManager``'s
groups are ``GroupCore``s built on its ``SharedParts`` (``GroupCore.joined``). The encoder-decoder
cross-attention tables are not a group's: a ``BlockManager`` owns them (kvlab.blocks.vllm_v0); a group takes
the blocks of a new table with its own (``_admit``'s ``cross_blocks``) and passes a record's link on to a fork.
"""

import dataclasses

from kvlab.blocks.allocations import Allocation, allocation_of, check_block_size_matches, check_sequence
from kvlab.blocks.cross_attention import CrossTables
from kvlab.blocks.drafts import SpeculativeDrafts, share_drafts
from kvlab.blocks.hashing import prompt_blocks, sealed_through
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import NULL_BLOCK
from kvlab.blocks.manager_steps import GroupSteps
from kvlab.blocks.planning import cached_prefix, plan_allocation
from kvlab.blocks.prefix_index import ROOT
from kvlab.blocks.sequence import Sequence, SequenceStatus, copy_tokens, set_allocation_record
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int


@serialized
class GroupCore(GroupSteps, SpeculativeDrafts):
    # ---- the group's own questions ---------------------------------------------------------------------
    def _block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's block table in this group (CPU block ids while it is swapped out)."""
        return list(allocation_of(self, seq).table)

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

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s leading full blocks found in the prefix cache now (at most all but the last
        token, as ``allocate`` would hit); works for allocated and waiting sequences. (kvlab's V1-style
        scheduler asks it before a chunked ``allocate``; vLLM V0 has it too.)"""
        check_block_size_matches(self, check_sequence(seq))
        if not self.enable_prefix_caching or seq.num_tokens == 0:
            return 0
        hashes, contents = prompt_blocks(seq, self.block_size, self.hash_fn)
        hits, tier_hits = cached_prefix(self._pool, hashes, contents, (seq.num_tokens - 1) // self.block_size,
                                        self.group)
        return (len(hits) + len(tier_hits)) * self.block_size

    def make_prefix_cache_stats(self):
        """The prefix-cache counters of this run: a ``PrefixCacheStats`` of the lookups since the last call
        (or since the manager was made or ``reset_prefix_cache``), then a new run starts. vLLM V1's
        ``KVCacheManager.make_prefix_cache_stats()`` ("get (and reset)"); ``stats`` stays cumulative."""
        run = self.stats.since(self._stats_mark)
        self._stats_mark = dataclasses.replace(self.stats)
        return run

    # ---- fork's half ---------------------------------------------------------------------------------------
    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """fork's bookkeeping (no policy call): ``child`` takes the parent's tokens and counters and shares its
        blocks, drafts in flight too (kvlab.blocks.drafts) and its request group's cross-attention table."""
        alloc = self._on_gpu(parent)
        child.block_size = parent.block_size
        copy_tokens(parent, child)
        twin = alloc.copy_for(child)
        if parent.num_draft_tokens:
            share_drafts(alloc, twin)
        self._pool.claim(twin.live_blocks(), 0)  # all in use by the parent: none was free
        CrossTables.share(alloc, twin)
        self._adopt(twin, child.num_cached_tokens)
        if self._sink is not None:
            self._sink.forked(child.seq_id, parent.seq_id)

    # ---- the halves of allocate and free ------------------------------------------------------------
    def _adopt(self, alloc: Allocation, num_cached_tokens: int) -> None:
        self._allocs.add(alloc)
        seq = alloc.seq
        set_allocation_record(seq, alloc)
        seq.num_cached_tokens, seq.status = num_cached_tokens, SequenceStatus.RUNNING

    def _admit(self, seq, plan, new_blocks, num_revived: int, cross_blocks=()) -> None:
        """allocate's bookkeeping, once the policy handed out ``new_blocks`` (and ``cross_blocks``, a new
        cross-attention table's, which its owner attaches: kvlab.blocks.vllm_v0) and took ``num_revived`` of the
        plan's live hits out of the free set (cannot fail): pin the live hits, seal the prompt's blocks this step
        writes, and record the sequence."""
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
        CrossTables.detach(alloc)
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
