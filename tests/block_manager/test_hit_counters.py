"""Hit rates that mean what they say (issue 25 §3): a recomputation after preemption is not a prefix hit, per-run
counters beside the cumulative ones, the offload tier's hit rate as the "cpu" one, and what is hittable at all."""

import pytest
from helpers import allocated, grow

from kvlab import BlockManager, Sequence
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.vllm_v0 import BlockSpaceManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec


def preempted_and_readmitted(m):
    """A 10-token prompt (2 full blocks of 4, no hits) decodes 3 tokens, is preempted by recompute, and is
    allocated again: its 13 tokens find the 3 full blocks it computed itself."""
    seq = allocated(m, range(10))
    grow(m, seq, [50, 51, 52])
    m.free(seq, preempted=True)
    m.allocate(seq)
    return seq


def test_a_recompute_after_preemption_is_counted_as_recomputed_not_as_hits():
    m = BlockSpaceManager(16, block_size=4)
    seq = preempted_and_readmitted(m)
    assert seq.num_cached_tokens == 12  # the blocks are still reused: only the counting differs
    s = m.stats
    assert (s.queried_tokens, s.queried_blocks, s.hit_tokens, s.hit_blocks) == (10, 2, 0, 0)
    assert (s.recomputed_queried_tokens, s.recomputed_queried_blocks) == (13, 3)
    assert (s.recomputed_tokens, s.recomputed_blocks) == (12, 3)
    assert s.hit_rate == 0.0 and m.get_prefix_cache_hit_rate("gpu") == 0.0
    # Another request's hit on those blocks is a prefix hit.
    other = allocated(m, [*range(10), 50, 51, 52, 99])
    assert other.num_cached_tokens == 12
    assert (s.hit_tokens, s.hit_blocks, s.recomputed_blocks) == (12, 3, 3)
    m.check_invariants()


def test_every_later_lookup_of_a_preempted_sequence_is_a_recomputation():
    m = BlockManager(16, block_size=4)
    seq = preempted_and_readmitted(m)
    grow(m, seq, [53, 54, 55, 56])
    m.free(seq, preempted=True)
    m.allocate(seq)
    assert seq.num_preemptions == 2 and seq.num_cached_tokens == 16
    assert (m.stats.hit_blocks, m.stats.recomputed_blocks, m.stats.recomputed_queried_tokens) == (0, 3 + 4, 13 + 17)


def test_a_hybrid_managers_recompute_is_not_a_hit_either():
    m = HybridBlockManager(32, 4, groups=[FullAttentionSpec(), FullAttentionSpec()])
    preempted_and_readmitted(m)
    assert (m.stats.hit_blocks, m.stats.recomputed_blocks) == (0, 3)  # the hit every group serves, counted once


def test_the_offload_tier_does_not_count_a_recompute():
    m = BlockManager(16, block_size=4, num_offload_blocks=4)
    preempted_and_readmitted(m)
    tier = m.tier_stats
    assert (tier.gpu_hit_blocks, tier.tier_hit_blocks, tier.miss_blocks, tier.miss_tokens) == (0, 0, 2, 10)


def test_make_prefix_cache_stats_gives_each_run_and_keeps_the_cumulative_counters():
    m = BlockManager(16, block_size=4)
    for _ in range(2):
        m.free(allocated(m, range(9)))          # 2 blocks queried, then 2 hit
    first = m.make_prefix_cache_stats()
    assert (first.queried_blocks, first.hit_blocks, first.hit_tokens, first.queried_tokens) == (4, 2, 8, 18)
    assert m.make_prefix_cache_stats().queried_tokens == 0  # a new run began
    m.free(allocated(m, range(5)))               # 1 block queried, 1 hit
    run = m.make_prefix_cache_stats()
    assert (run.queried_blocks, run.hit_blocks, run.hit_rate) == (1, 1, pytest.approx(4 / 5))
    assert (m.stats.queried_blocks, m.stats.hit_blocks) == (5, 3)  # cumulative
    m.free(allocated(m, range(9)))
    assert m.reset_prefix_cache()
    m.free(allocated(m, range(9)))               # after the reset: a miss; the run starts at the reset
    run = m.make_prefix_cache_stats()
    assert (run.queried_blocks, run.hit_blocks) == (2, 0) and run == m.stats


def test_the_cpu_hit_rate_is_the_offload_tiers():
    m = BlockSpaceManager(5, block_size=2, num_offload_blocks=4)
    assert m.get_prefix_cache_hit_rate("cpu") == 0.0  # a tier, not asked yet
    first = allocated(m, [1, 2, 3, 4, 5, 6, 8])   # 3 full blocks, all missed
    m.free(first)
    m.free(allocated(m, [7] * 9))                 # 4 more misses; evicts (offloads) the first prompt's blocks
    again = allocated(m, [1, 2, 3, 4, 5, 6, 9])   # promoted from the tier
    assert again.num_cached_tokens == 6 and m.tier_stats.tier_hit_blocks == 3
    assert m.get_prefix_cache_hit_rate("cpu") == pytest.approx(3 / 10)
    assert m.get_prefix_cache_hit_rate("gpu") == 0.0
    assert BlockSpaceManager(5, block_size=2).get_prefix_cache_hit_rate("cpu") == -1.0  # no tier: no CPU cache


def test_only_full_blocks_before_the_last_token_are_hittable():
    m = BlockManager(16, block_size=4)
    m.free(allocated(m, range(8)))
    exact = allocated(m, range(8))                # exactly 2 blocks: the last token's block is computed
    assert exact.num_cached_tokens == 4
    longer = allocated(m, range(9))               # 2 full blocks and a partial one: both full blocks hit
    assert longer.num_cached_tokens == 8
    short = allocated(m, range(3))                # shorter than a block: a correct 0
    assert short.num_cached_tokens == 0
    assert (m.stats.queried_blocks, m.stats.hit_blocks, m.stats.queried_tokens) == (6, 3, 28)

