import random

import pytest
from helpers import allocated, grow

from kvlab import AllocStatus, BlockManager, Sequence


def test_seed_example_b_reuses_a_and_c_reuses_nothing():
    manager = BlockManager(16, block_size=4)
    a = allocated(manager, range(1, 9))
    b = allocated(manager, range(1, 11))
    c = allocated(manager, [0, *range(2, 11)])
    assert b.block_table[:2] == a.block_table and b.num_cached_tokens == 8
    # C's second block holds A's tokens 5..8, but after a different first block: it must not hit.
    assert c.block(1) == a.block(1)
    assert not set(c.block_table) & set(a.block_table + b.block_table) and c.num_cached_tokens == 0
    assert [manager.ref_count(x) for x in a.block_table] == [2, 2]
    assert manager.stats.hit_blocks == 2 and manager.stats.queried_blocks == 6
    assert manager.stats.hit_rate == pytest.approx(8 / 28)
    manager.check_invariants()


def test_partial_blocks_are_never_shared():
    manager = BlockManager(16, block_size=4)
    a = allocated(manager, [1, 2, 3, 4, 5, 6])
    b = allocated(manager, [1, 2, 3, 4, 5, 6])
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_cached_tokens == 4


def test_whole_prompt_hit_still_computes_one_token():
    manager = BlockManager(16, block_size=4)
    a = allocated(manager, range(8))
    b = allocated(manager, range(8))
    assert b.num_cached_tokens == 4 < b.num_tokens
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_blocks_sealed_after_a_duplicate_block_still_chain_to_the_cached_prefix():
    manager = BlockManager(16, block_size=4)
    allocated(manager, range(8))
    b = allocated(manager, range(8))       # block 1 is a fresh duplicate of A's cached block 1
    grow(manager, b, [100, 101, 102, 103])  # seals block 2 after the duplicate
    c = allocated(manager, [*range(8), 100, 101, 102, 103, 7])
    assert c.num_cached_tokens == 12 and c.block_table[2] == b.block_table[2]


def test_prompt_blocks_are_hittable_as_soon_as_allocate_returns():
    manager = BlockManager(8, block_size=4)
    a = allocated(manager, range(9))
    assert all(manager.is_cached(b) for b in a.block_table[:2]) and not manager.is_cached(a.block_table[2])
    assert allocated(manager, range(9)).num_cached_tokens == 8


def test_decode_block_is_hittable_once_append_slots_seals_it():
    manager = BlockManager(8, block_size=4)
    a = allocated(manager, [1, 2, 3, 4, 5, 6])
    grow(manager, a, [7])
    assert not manager.is_cached(a.block_table[1])
    a.append_token(8)
    manager.append_slots(a)
    assert manager.is_cached(a.block_table[1]) and manager.block_hash(a.block_table[1]) is not None
    b = allocated(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8


def test_warm_hit_takes_a_freed_block_back():
    manager = BlockManager(6, block_size=4)
    a = allocated(manager, range(9))
    kept = a.block_table[:2]
    manager.free(a)
    assert manager.num_free_blocks == 6 and all(manager.is_cached(b) for b in kept)
    b = allocated(manager, range(10))
    assert b.block_table[:2] == kept and manager.num_free_blocks == 3
    assert [manager.ref_count(x) for x in kept] == [1, 1]


def test_reuse_order_uncached_first_then_lru_with_chain_tail_first():
    manager = BlockManager(8, block_size=2)
    x = allocated(manager, [1, 2, 3, 4, 5, 6])  # blocks 0, 1, 2, all sealed
    y = allocated(manager, [7, 8, 9, 10])       # blocks 3, 4
    assert (x.block_table, y.block_table) == ((0, 1, 2), (3, 4))
    manager.free(x)
    manager.free(y)
    assert manager.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    z = allocated(manager, [11, 12, 13, 14, 15, 16, 17, 18, 19])  # 5 blocks: 5, 6, 7, then evicts 2, 1
    assert z.block_table == (5, 6, 7, 2, 1) and manager.num_evictions == 2
    assert not manager.is_cached(1) and manager.block_hash(1) is None  # evicted, now z's partial block
    assert manager.is_cached(0)                                          # x's head block is still warm


def test_can_allocate_counts_hits_on_blocks_in_use_as_free():
    manager = BlockManager(3, block_size=4)
    a = allocated(manager, range(9))           # all 3 blocks in use
    assert manager.can_allocate(Sequence([*range(8), 99], 4)) is AllocStatus.LATER  # 1 new block, none free
    manager = BlockManager(4, block_size=4)
    a = allocated(manager, range(9))
    assert manager.can_allocate(Sequence([*range(8), 99, 98, 97, 96, 95], 4)) is AllocStatus.LATER
    assert manager.can_allocate(Sequence([*range(8), 99], 4)) is AllocStatus.OK
    manager.free(a)  # now the two prefix blocks are free but cached: a hit on them consumes free blocks
    assert manager.can_allocate(Sequence([*range(8), *range(50, 57)], 4)) is AllocStatus.OK
    assert manager.can_allocate(Sequence([*range(8), *range(50, 58), 1], 4)) is AllocStatus.NEVER


def test_can_allocate_with_watermark_and_never():
    manager = BlockManager(10, block_size=1, watermark=0.5)  # keeps 5 blocks in reserve
    assert manager.can_allocate(Sequence(range(6), 1)) is AllocStatus.NEVER
    assert manager.can_allocate(Sequence(range(3), 1)) is AllocStatus.OK
    allocated(manager, range(100, 103))
    assert manager.can_allocate(Sequence(range(3), 1)) is AllocStatus.LATER
    assert manager.can_allocate(Sequence(range(2), 1)) is AllocStatus.OK
    assert manager.can_allocate(Sequence(range(3), 1), num_lookahead_slots=3) is AllocStatus.NEVER


def test_constant_hash_cannot_chain_a_hit_through_a_different_parent():
    manager = BlockManager(16, block_size=2, hash_fn=lambda parent, tokens: 0)
    a = allocated(manager, [1, 2, 1, 2, 5])        # blocks [1,2] [1,2] [5]: every full block hashes to 0
    b = allocated(manager, [1, 2, 1, 2, 1, 2, 7])
    # Block 1 of b has a's block-1 tokens and a's block 1 has a's block 0 as parent, but only a's block 0 is
    # registered under hash 0; the guard must stop b at one hit.
    assert b.num_cached_tokens == 2 and b.block_table[0] == a.block_table[0]
    assert set(b.block_table[1:]).isdisjoint(a.block_table)
    c = allocated(manager, [3, 4, 1, 2, 9])        # [1,2] after [3,4]: same tokens as a's block 0, other parent
    assert c.num_cached_tokens == 0


def test_weak_hash_never_shares_different_prefixes():
    """Every block hashes alike: the guard (same tokens AND same parent content) must still be exact."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    manager = BlockManager(400, block_size=2, hash_fn=lambda parent, tokens: 42)
    strong = BlockManager(400, block_size=2)
    seqs = []
    for _ in range(40):
        tokens = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        seqs.append(allocated(manager, tokens))
        allocated(strong, tokens)
        if rng.random() < 0.3:
            manager.free(seqs.pop(rng.randrange(len(seqs))))
        manager.check_invariants()
        owner = {}
        for seq in seqs:
            for i, block in enumerate(seq.block_table[:seq.num_cached_tokens // 2]):
                prefix = seq.token_ids[:2 * (i + 1)]
                assert owner.setdefault(block, prefix) == prefix, "two different prefixes share a block"
    assert manager.stats.hit_tokens > 0              # the guard still lets true hits through
    assert strong.stats.hit_tokens >= manager.stats.hit_tokens


def test_disabled_prefix_caching_shares_nothing():
    manager = BlockManager(8, block_size=2, enable_prefix_caching=False)
    a, b = allocated(manager, [1, 2, 3]), allocated(manager, [1, 2, 3])
    assert not set(a.block_table) & set(b.block_table)
    assert manager.block_hash(a.block_table[0]) is None and manager.stats.queried_tokens == 0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    manager = BlockManager(8, block_size=2)
    a = allocated(manager, [1, 2, 3, 4, 5])
    assert manager.reset_prefix_cache() is False and manager.is_cached(a.block_table[0])
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert not any(manager.is_cached(b) for b in range(8)) and manager.stats.queried_tokens == 0
    assert manager.stats.hit_rate == 0.0
    assert allocated(manager, [1, 2, 3, 4, 5]).num_cached_tokens == 0
    manager.check_invariants()


def test_custom_eviction_policy_instance_and_events():
    from kvlab.blocks.eviction import LRUPolicy

    manager = BlockManager(4, block_size=2, eviction=LRUPolicy(), record_events=True)
    a = allocated(manager, [1, 2, 3])
    manager.free(a)
    allocated(manager, [1, 2, 9])
    assert [(e.kind, e.block_id) for e in manager.events] == [
        ("miss", 0), ("miss", 1), ("seal", 0), ("allocate", None),   # a: block 0 full, block 1 partial
        ("release", 1), ("release", 0), ("free", None),              # freed tail first
        ("hit", 0), ("miss", 2), ("allocate", None)]                 # [1, 2, 9] hits block 0


def test_can_allocate_then_allocate_hashes_the_prompt_once():
    calls = []

    def counting_hash(parent, tokens):
        calls.append(tokens)
        return hash((parent, tokens))

    manager = BlockManager(8, block_size=2, hash_fn=counting_hash)
    seq = Sequence([1, 2, 3, 4, 5], 2)
    manager.can_allocate(seq)
    manager.allocate(seq)
    assert calls == [(1, 2), (3, 4)]
    other = Sequence([1, 2, 3, 4, 5], 2)
    manager.can_allocate(other)
    other.append_token(6)        # the prompt grew after can_allocate: allocate hashes only the new full block
    manager.allocate(other)
    assert calls[2:] == [(1, 2), (3, 4), (5, 6)]
    assert other.num_cached_tokens == 4
