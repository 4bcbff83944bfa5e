"""The value API: ``lookup`` once, pass the hit into ``can_allocate`` and ``allocate`` (vLLM V1 passes its one
lookup's hit into ``allocate_slots``), which return what they did instead of leaving it in side queues."""

import pytest
from helpers import snapshot

from kvlab import BlockManager, InvalidArgumentError, Sequence
from kvlab.blocks import Admitted, PrefixHit
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.manager import HybridBlockManager

BS = 4


def warm(m, tokens):
    seq = Sequence(tokens, BS)
    m.allocate(seq)
    m.free(seq)


def test_a_hit_passed_in_is_what_allocate_would_find_and_allocate_says_what_it_did():
    m = BlockManager(16, BS)
    warm(m, range(13))
    seq = Sequence(list(range(12)) + [99, 98], BS)
    hit = m.lookup(seq)
    assert isinstance(hit, PrefixHit) and hit.num_tokens == 12 and hit.num_external_tokens == 0
    assert m.can_allocate(seq, hit=hit) and m.get_num_cached_tokens(seq) == 12
    admitted = m.allocate(seq, hit=hit)
    assert isinstance(admitted, Admitted) and admitted.num_cached_tokens == seq.num_cached_tokens == 12
    assert tuple(admitted.new_blocks[0]) == seq.block_table[3:] and admitted.tier_moves == []
    m.check_invariants()


def test_a_stale_hit_is_refused_and_changes_nothing():
    m = BlockManager(5, BS)
    warm(m, range(9))                         # blocks of [0..3], [4..7] cached, free
    seq = Sequence(list(range(8)) + [50], BS)
    hit = m.lookup(seq)
    assert hit.num_tokens == 8
    other = Sequence(range(100, 117), BS)     # 5 blocks: evicts both cached blocks
    m.allocate(other)
    m.free(other)
    before = snapshot(m)
    for call in (m.can_allocate, m.allocate):
        with pytest.raises(InvalidArgumentError, match="stale"):
            call(seq, hit=hit)
    assert snapshot(m) == before and seq.block_table == ()
    m.allocate(seq, hit=m.lookup(seq))        # looked up again: no hit, and it fits
    assert seq.num_cached_tokens == 0
    m.check_invariants()


def test_a_hit_survives_evictions_that_spare_its_blocks():
    m = BlockManager(8, BS)
    warm(m, range(100, 109))                  # two cached blocks, freed first: evicted first
    warm(m, range(9))
    seq = Sequence(list(range(8)) + [50], BS)
    hit = m.lookup(seq)
    warm(m, range(200, 217))                  # 5 blocks: the 4 uncached ones and one of the first prompt's
    assert m.num_evictions == 1
    m.allocate(seq, hit=hit)
    assert seq.num_cached_tokens == 8
    m.check_invariants()


@pytest.mark.parametrize("wrong", ["another sequence's", "not a hit", "another manager's"])
def test_a_hit_that_is_not_this_sequences_lookup_is_refused(wrong):
    m = BlockManager(16, BS)
    seq, other = Sequence(range(9), BS), Sequence(range(9), BS)
    hit = {"another sequence's": m.lookup(other), "not a hit": (0, 4),
           "another manager's": HybridBlockManager(16, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(8)])
           .lookup(seq)}[wrong]
    with pytest.raises(InvalidArgumentError, match="lookup"):
        m.allocate(seq, hit=hit)
    assert seq.block_table == ()


def test_a_hybrid_lookup_is_one_per_group_cut_to_what_every_group_serves():
    m = HybridBlockManager(32, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(4)])
    warm(m, range(13))
    seq = Sequence(list(range(12)) + [7], BS)
    hit = m.lookup(seq)
    assert [len(blocks) for blocks in hit.hits] == [3, 3] and hit.num_tokens == 12
    admitted = m.allocate(seq, hit=hit)
    assert seq.num_cached_tokens == 12 and len(admitted.new_blocks) == 2
    m.check_invariants()


@pytest.mark.parametrize("groups", [None, [FullAttentionSpec(), SlidingWindowSpec(6)]])
def test_use_eagle_gives_up_the_last_hit_block_as_vllm_does(groups):
    # vLLM issue #54360's law for a fully cached prompt of L tokens: hits = max(0, floor((L - 1) / B) - 1) * B.
    for length in range(1, 6 * BS):
        eagle = (HybridBlockManager(32, BS, groups=groups, use_eagle=True) if groups else
                 BlockManager(32, BS, use_eagle=True))
        warm(eagle, range(length + BS))
        seq = Sequence(range(length), BS)
        hit = eagle.lookup(seq)
        assert hit.num_tokens == max(0, (length - 1) // BS - 1) * BS
        assert eagle.allocate(seq, hit=hit).num_cached_tokens == hit.num_tokens
        eagle.check_invariants()


def test_use_eagle_gives_up_the_tiers_last_block_when_the_hit_ends_in_the_tier():
    m = BlockManager(4, BS, num_offload_blocks=4, use_eagle=True)
    warm(m, range(13))                        # 3 cached blocks
    warm(m, range(100, 113))                  # evicts them to the tier
    seq = Sequence(list(range(12)) + [7], BS)
    hit = m.lookup(seq)
    assert len(hit.tier_hits) == 2 and hit.num_tokens == 8
    assert m.allocate(seq, hit=hit).num_cached_tokens == 8
    m.check_invariants()


def test_use_eagle_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="use_eagle"):
        BlockManager(8, BS, use_eagle="yes")


def test_a_hit_says_what_the_group_cut_and_the_eagle_drop_took():
    m = HybridBlockManager(32, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(6)], use_eagle=True)
    warm(m, range(25))
    seq = Sequence(list(range(20)) + [99], BS)  # 5 full blocks cached in both groups
    hit = m.lookup(seq)
    assert (hit.num_tokens, hit.num_cut_tokens, hit.num_eagle_tokens) == (16, 0, BS)
    full = BlockManager(32, BS)
    warm(full, range(9))
    hit = full.lookup(Sequence(range(9), BS))
    assert (hit.num_tokens, hit.num_cut_tokens, hit.num_eagle_tokens) == (8, 0, 0)
