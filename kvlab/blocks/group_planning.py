"""What a hybrid manager's call needs from every KV cache group, worked out before anything changes.

``HybridBlockManager`` (kvlab.blocks.hybrid_manager) plans every group's part of a call here, checks room for
all of them, and only then acts (kvlab.blocks.group_manager tells how); like ``kvlab.blocks.planning``, this
is pure.

Hits (vLLM's ``find_longest_cache_hit``): the hit is the longest prefix every group serves. kvlab's lookup
is prefix-closed in every group (a hit's chain is verified from block 0; a window group's out-of-window hits
are proved but not pinned), so that is the minimum over groups, and vLLM's fixed-point iteration ends in one
pass. vLLM's SlidingWindowManager is more generous: it scans right to left and needs only the blocks under
the window cached, so kvlab misses hits whose early blocks were evicted. ``allocate`` pins every group's hits
while the groups take their new blocks, so one group's new blocks never evict another's planned hit.
"""


def plan_admissions(groups, shadows, lookahead: int, num_new_tokens) -> tuple[int, list]:
    """(the hit every group serves, in blocks; each group's AllocationPlan with its hits cut to it). Each
    group's lookup is cut to the hit of the groups before it, so the last one finds the common hit."""
    common = None
    for group, shadow in zip(groups, shadows):
        common = len(group.plan_admission(shadow, lookahead, None, common).hits)
    return common, [group.plan_admission(shadow, lookahead, num_new_tokens, common)
                    for group, shadow in zip(groups, shadows)]


def hit_pins(pool, plans) -> tuple[list, list, int]:
    """(every group's hits, the free ones among them, the free blocks allocate takes). All hits are pinned while
    the groups take their new blocks, a window group's out-of-window ones too: were one evicted by another
    group's new blocks, that group's chain would break. So can_allocate counts them."""
    pins = [block for plan in plans for block in plan.hits]
    revived = [block for block in pins if not pool.ref[block]]
    fresh = sum(plan.live_blocks - len(plan.hits) + plan.first_live for plan in plans)
    return pins, revived, fresh + len(revived)


def step_needs(steps) -> list[int]:
    """Each group's free blocks its planned step ((record, StepPlan, drafts)) takes, less those it releases."""
    return [plan.blocks_needed - len(plan.freed) for _, plan, _ in steps]


def cpu_blocks_needed(swap, moving) -> int:
    """CPU blocks a swap-out takes, every group's ``moving`` ((record, (GPU blocks, None))) together."""
    return sum(swap.blocks_needed_out(blocks) for _, (blocks, _) in moving)
