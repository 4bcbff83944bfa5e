"""A tier shared by several managers (a fleet's replicas, Mooncake's global store): a block replica A offloads is
hit by replica B, verified as a GPU hit is (content ids interned across them), and a chain B computed itself
continues in A's entries."""

import pytest
from helpers import TierMoves

from kvlab import BlockManager, InvalidArgumentError, Sequence
from kvlab.blocks.tiers import make_shared_tier

SYSTEM = [1, 2, 3, 4, 5, 6]  # three blocks of 2


def evict_everything(m, n=9):
    other = Sequence([7] * n, m.block_size)
    m.allocate(other)
    m.free(other)


def replicas(n=2, gpu_blocks=5, tier_slots=8, **options):
    tier = make_shared_tier(tier_slots)
    return tier, [BlockManager(gpu_blocks, block_size=2, shared_tier=tier, **options) for _ in range(n)]


def test_a_block_replica_a_offloads_is_hit_by_replica_b():
    tier, (a, b) = replicas()
    a_moves, b_moves = TierMoves(a), TierMoves(b)
    first = Sequence(SYSTEM + [8], 2)
    a.allocate(first)
    a.free(first)
    evict_everything(a)
    assert {kind for kind, _, _ in a_moves.take()} == {"offload"}
    other = Sequence(SYSTEM + [9], 2)
    assert b.get_num_cached_tokens(other) == 6
    b.allocate(other)
    assert other.num_cached_tokens == 6
    assert [kind for kind, _, _ in b_moves.take()] == ["promote"] * 3
    assert b.tier_stats is a.tier_stats is tier.stats and tier.stats.tier_hit_blocks == 3
    for m in (a, b):
        m.check_invariants()


def test_a_chain_replica_b_computed_itself_continues_in_replica_a_entries():
    """B holds the first block on its GPU (sealed by B); A offloaded all three: B hits one on its GPU and
    two in the tier, because the first block has the same content id on both replicas."""
    tier, (a, b) = replicas()
    mine = Sequence(SYSTEM[:2] + [5], 2)
    b.allocate(mine)  # B computes block [1, 2] itself and keeps it
    first = Sequence(SYSTEM + [8], 2)
    a.allocate(first)
    a.free(first)
    evict_everything(a)
    other = Sequence(SYSTEM + [9], 2)
    b.allocate(other)
    assert other.num_cached_tokens == 6
    assert (tier.stats.gpu_hit_blocks, tier.stats.tier_hit_blocks) == (1, 2)
    for m in (a, b):
        m.check_invariants()


def test_a_shared_tier_hit_is_verified_bytes_keys_and_parent():
    always_7 = lambda parent, ids: 7  # noqa: E731: every block has the same hash
    tier, (a, b) = replicas(hash_fn=always_7)
    first = Sequence(SYSTEM + [8], 2)
    a.allocate(first)
    a.free(first)
    evict_everything(a)
    for other in (Sequence([9, 9] + SYSTEM[2:] + [8], 2), Sequence(SYSTEM + [8], 2, cache_salt="tenant-b")):
        assert b.get_num_cached_tokens(other) == 0
    b.check_invariants()


@pytest.mark.parametrize("options, match", [
    (dict(shared_tier=object()), "shared_tier must be a tier from"),
    (dict(shared_tier=make_shared_tier(2), num_offload_blocks=2), "num_offload_blocks=0"),
    (dict(shared_tier=make_shared_tier(2), enable_prefix_caching=False), "needs prefix caching on"),
])
def test_bad_shared_tiers_are_refused(options, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BlockManager(4, block_size=2, **options)


@pytest.mark.parametrize("num_slots", [0, -1, 2.5])
def test_a_shared_tier_needs_a_positive_slot_count(num_slots):
    with pytest.raises(InvalidArgumentError, match="num_slots"):
        make_shared_tier(num_slots)
