"""What a coordinator's call needs from every KV cache group, worked out before anything changes.

The coordinator (kvlab.blocks.coordinator: a ``BlockManager``, one group, or a ``HybridBlockManager``) plans
every group's part of a call here, checks room for all of them, and only then acts (kvlab.blocks.group_manager
tells how); like ``kvlab.blocks.planning``, this is pure.

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
    if len(groups) == 1:  # one group: its own hit is the common one, planned once
        plan = groups[0].plan_admission(shadows[0], lookahead, num_new_tokens)
        return len(plan.hits), [plan]
    common = None
    for group, shadow in zip(groups, shadows):
        common = len(group.plan_admission(shadow, lookahead, None, common).hits)
    return common, [group.plan_admission(shadow, lookahead, num_new_tokens, common)
                    for group, shadow in zip(groups, shadows)]


def hit_pins(pool, plans) -> tuple[list, list, int]:
    """(the hits the coordinator pins while the groups take their new blocks, the free ones among them, the free
    blocks allocate takes). With several groups all hits are pinned, a window group's out-of-window ones too:
    were one evicted by another group's new blocks, that group's chain would break. So can_allocate counts
    them. One group pins nothing: its live hits are its own to claim (the free ones revived), its chain goes on
    from its last hit, which it holds, and its plan counted the free blocks it takes."""
    ref = pool.ref
    if len(plans) == 1:
        plan = plans[0]
        return (), [block for block in plan.hits[plan.first_live:] if not ref[block]], plan.needed_free
    pins = [block for plan in plans for block in plan.hits]
    revived = [block for block in pins if not ref[block]]
    fresh = sum(plan.live_blocks - len(plan.hits) + plan.first_live for plan in plans)
    return pins, revived, fresh + len(revived)


def free_blocks_needed(pool, plans) -> int:
    """The free blocks ``allocate`` takes by these plans (``hit_pins``' third answer, cheaper for one group)."""
    return plans[0].needed_free if len(plans) == 1 else hit_pins(pool, plans)[2]


def step_needs(steps) -> list[int]:
    """Each group's free blocks its planned step ((record, StepPlan, drafts)) takes, less those it releases."""
    return [plan.blocks_needed - len(plan.freed) for _, plan, _ in steps]


def cpu_blocks_needed(swap, moving) -> int:
    """CPU blocks a swap-out takes, every group's ``moving`` ((record, (GPU blocks, None))) together."""
    return sum(swap.blocks_needed_out(blocks) for _, (blocks, _) in moving)
