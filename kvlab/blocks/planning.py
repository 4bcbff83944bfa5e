"""What an operation needs, worked out before anything changes.

``allocate`` and ``append_slots`` first plan (which cached blocks a prompt hits, which blocks a step writes or
copies, how many it adds, which ones leave the sliding window), then check there is room, then act. Planning
is pure, so a refused or failing operation leaves no trace, and ``can_allocate`` / ``can_append_slots`` give
exactly the answer the operation itself would.
"""

from typing import NamedTuple


def first_live_block(first_query: int, sliding_window, block_size: int) -> int:
    """Leading blocks that no query at position >= ``first_query`` can see: with a window of W, a query at
    position p sees keys p - W + 1 .. p, so blocks wholly before first_query - W + 1 can go."""
    if sliding_window is None:
        return 0
    return max(0, first_query - sliding_window + 1) // block_size


class AllocationPlan(NamedTuple):
    hashes: list       # the prompt's full blocks' hashes...
    contents: list     # ...and token bytes
    hits: list         # cached blocks matching its first full blocks
    first_live: int    # leading hits outside the sliding window (not pinned)
    live_blocks: int   # blocks the sequence holds after allocate (plus lookahead)
    needed_free: int   # of which come out of the free pool


def plan_allocation(pool, seq, hashes, contents, block_size, sliding_window, lookahead) -> AllocationPlan:
    n = seq.num_tokens
    # Never share the whole prompt: at least one token must be computed to produce logits.
    hits = pool.lookup(hashes, contents, (n - 1) // block_size)
    # The step's first query is the first uncached token.
    first_live = first_live_block(len(hits) * block_size, sliding_window, block_size)
    live_blocks = -(-(n + lookahead) // block_size) - first_live
    ref = pool.ref
    hits_in_use = sum(1 for block in hits[first_live:] if ref[block])
    return AllocationPlan(hashes, contents, hits, first_live, live_blocks, live_blocks - hits_in_use)


class StepPlan(NamedTuple):
    release_upto: int  # num_released after the step
    release: list      # blocks leaving the window, tail first (as free() releases)
    freed: list        # those of them that become free...
    freed_cached: list  # ...and whether each is cached
    touched: range     # indices of existing blocks the step writes
    copies: set        # those of them that are shared: copy-on-write
    num_new: int       # blocks to append

    @property
    def blocks_needed(self) -> int:
        return len(self.copies) + self.num_new


def plan_step(pool, alloc, block_size, sliding_window, lookahead) -> StepPlan:
    """The step computes positions ``alloc.num_written .. num_tokens - 1`` (its first query is the first
    position not written yet) and reserves ``lookahead`` more slots."""
    table, ref = alloc.table, pool.ref
    first_query = alloc.num_written
    release_upto = max(alloc.num_released, first_live_block(first_query, sliding_window, block_size))
    release = table[alloc.num_released:release_upto][::-1]
    end = alloc.seq.num_tokens + lookahead
    touched = range(first_query // block_size, min(len(table), -(-end // block_size)))
    copies = {i for i in touched if ref[table[i]] > 1}
    return StepPlan(release_upto, release, *pool.freed_by(release), touched, copies,
                    max(0, -(-end // block_size) - len(table)))
