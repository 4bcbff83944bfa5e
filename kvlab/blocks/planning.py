"""What an operation needs, worked out before anything changes.

``allocate`` and ``append_slots`` first plan (which cached blocks a prompt hits, which blocks a step writes or
copies, how many it adds, which ones leave the sliding window), then check there is room, then act. Planning
is pure, so a refused or failing operation leaves no trace, and ``can_allocate`` / ``can_append_slots`` give
exactly the answer the operation itself would.

Chunked prompts (vLLM V1's ``allocate_slots(request, num_new_tokens)``): a step schedules the next
``num_new_tokens`` tokens that have no slot yet, not necessarily all of them. Only those tokens get slots, and
only blocks whose last token they reach are sealed (become hittable): the step that writes a block's last
token is scheduled, so under the write-before-read rule a request hitting it in the same step reads K/V
written before its own attention; a block whose tokens are still to be computed is never hittable.

Which blocks a sequence keeps is its group's attention spec's to say (``spec``: kvlab.blocks.kv_cache_groups,
full attention or a sliding window): its release rule ``first_live_block`` and its ``least_peak_blocks``.
"""

from typing import NamedTuple

from kvlab.blocks.prefix_index import ROOT
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int


def new_tokens(seq, num_new_tokens, num_scheduled: int) -> int:
    """How many tokens a step schedules: ``num_new_tokens`` of those after position ``num_scheduled`` (they
    have no slot yet), or all of them for None."""
    remaining = seq.num_tokens - num_scheduled
    if num_new_tokens is None:
        return remaining
    if remaining == 0:
        raise InvalidArgumentError(f"num_new_tokens={num_new_tokens!r}, but every token of sequence {seq.seq_id} "
                                   "has a slot already (append_token first, or pass None)")
    try:
        return check_int("num_new_tokens", num_new_tokens, 1, remaining)
    except InvalidArgumentError as e:  # say where the bound comes from
        raise InvalidArgumentError(f"{e} (sequence {seq.seq_id} has {remaining} tokens without a slot after its "
                                   f"{num_scheduled} cached or scheduled ones; None schedules them all)") from None


def least_peak_blocks(scheduled: int, num_tokens: int, block_size: int, spec, lookahead: int) -> int:
    """The fewest blocks a sequence must hold at once to give positions ``scheduled .. num_tokens - 1`` their
    slots later, however they are chunked (0 if there are none): ``spec``'s rule
    (kvlab.blocks.kv_cache_groups: without a window, the whole sequence at its last token)."""
    if scheduled >= num_tokens:
        return 0
    return spec.least_peak_blocks(scheduled, num_tokens, block_size, lookahead)


class AllocationPlan(NamedTuple):
    hashes: list       # the prompt's full blocks' hashes...
    contents: list     # ...and token bytes
    hits: list         # cached blocks matching its first full blocks
    first_live: int    # leading hits outside the sliding window (not pinned)
    scheduled: int     # positions with slots after allocate: the hits plus the first chunk
    live_blocks: int   # blocks the sequence holds after allocate (plus lookahead)
    needed_free: int   # of which come out of the free pool
    peak_blocks: int   # blocks it must hold at once at some step until its prompt is done (at the least,
                       # however the rest is chunked; this step included)
    num_new: int       # blocks allocate takes for the positions after the hits (lookahead aside)
    num_sealed: int    # leading full blocks sealed once allocated: the hits plus those this step writes to the end
    tier_hits: tuple = ()  # offload-tier slots continuing the hits: promoted into the first new blocks


def cached_prefix(pool, hashes, contents, limit: int, group: int = 0) -> tuple[list[int], tuple]:
    """(the GPU blocks of KV cache ``group`` holding the prompt's first full blocks, then the offload tier's
    slots continuing them): its cached prefix, at most ``limit`` blocks in all. Pure."""
    hits = pool.index.lookup(hashes, contents, limit, ROOT, group)
    return hits, (pool.tier.lookup(hashes, contents, limit, hits, pool.index) if pool.tier is not None else ())


def plan_allocation(pool, seq, hashes, contents, block_size, spec, lookahead,
                    num_new_tokens, max_hits=None, group: int = 0) -> AllocationPlan:
    """Prefix hits are looked up once, here at admission, in KV cache ``group``'s namespace of the index (at
    most ``max_hits`` blocks: the hybrid manager's hit every group can serve); the first step computes the
    first ``num_new_tokens`` tokens after them (None: the whole rest of the prompt)."""
    n = seq.num_tokens
    # Never share the whole prompt: at least one token must be computed to produce logits.
    limit = (n - 1) // block_size
    hits, tier_hits = cached_prefix(pool, hashes, contents, limit if max_hits is None else min(limit, max_hits), group)
    cached = (len(hits) + len(tier_hits)) * block_size
    scheduled = cached + new_tokens(seq, num_new_tokens, cached)
    # The step's first query is the first uncached token.
    first_live = spec.first_live_block(cached, block_size)
    live_blocks = -(-(scheduled + lookahead) // block_size) - first_live
    ref = pool.ref
    hits_in_use = sum(1 for block in hits[first_live:] if ref[block])
    # A chunk that fits is no use if the rest of the prompt never can: admission looks at the whole prompt.
    peak = max(live_blocks, least_peak_blocks(scheduled, n, block_size, spec, lookahead))
    return AllocationPlan(hashes, contents, hits, first_live, scheduled, live_blocks, live_blocks - hits_in_use,
                          peak, -(-scheduled // block_size) - len(hits), min(len(hashes), scheduled // block_size),
                          tier_hits)


class StepPlan(NamedTuple):
    scheduled: int     # seq.num_computed_tokens after the step: the positions it computes end here (drafts included)
    release_upto: int  # num_released after the step
    release: list      # blocks leaving the window, tail first (as free() releases)
    freed: list        # those of them that become free...
    freed_cached: list  # ...and whether each is cached
    touched: range     # indices of existing blocks the step writes
    copies: set        # those of them that are shared: copy-on-write
    num_new: int       # blocks to append
    unseal: list       # touched blocks held by this sequence alone that a fork sibling sealed (kvlab.blocks.drafts)

    @property
    def blocks_needed(self) -> int:
        return len(self.copies) + self.num_new


def plan_step(pool, alloc, block_size, spec, lookahead, num_new_tokens, num_drafts=0) -> StepPlan:
    """The step computes positions ``seq.num_computed_tokens .. scheduled - 1`` (its first query is the first
    position not written yet; ``scheduled`` is num_tokens unless ``num_new_tokens`` says fewer, plus
    ``num_drafts`` draft positions after the last token) and reserves ``lookahead`` more slots. A sealed block
    is never written in place: shared, it is copied; held by this sequence alone, it leaves the prefix cache."""
    table, ref, content = alloc.table, pool.ref, pool.index.content
    seq = alloc.seq
    first_query = seq.num_computed_tokens
    scheduled = first_query + new_tokens(seq, num_new_tokens, first_query)
    if num_drafts and scheduled != seq.num_tokens:
        raise InvalidArgumentError(f"draft tokens follow the last token: a step with {num_drafts} of them must "
                                   f"schedule all {seq.num_tokens - first_query} tokens of sequence {seq.seq_id} "
                                   "without a slot (num_new_tokens=None)")
    scheduled += num_drafts
    release_upto = max(alloc.num_released, spec.first_live_block(first_query, block_size))
    release = table[alloc.num_released:release_upto][::-1]
    end = scheduled + lookahead
    touched = range(first_query // block_size, min(len(table), -(-end // block_size)))
    copies = {i for i in touched if ref[table[i]] > 1}
    unseal = [table[i] for i in touched if i not in copies and content[table[i]] > ROOT]
    return StepPlan(scheduled, release_upto, release, *pool.freed_by(release), touched, copies,
                    max(0, -(-end // block_size) - len(table)), unseal)
