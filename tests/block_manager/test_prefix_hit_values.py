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
