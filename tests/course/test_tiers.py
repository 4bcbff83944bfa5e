"""The tier replay of notebooks 14a/14b: known per-tier counts on a pool too small to keep a prompt, and bad
input refused before any replay."""

import pytest

from kvlab import Sequence
from kvlab.course.tiers import replay_through_tier, tier_hit_runs
from kvlab.errors import InvalidArgumentError

A, B = list(range(10)), list(range(100, 110))


def evict_then_return():
    """Block size 4, to a pool of 3 blocks: A (2 full blocks and a partial one) fills the pool; B evicts A's
    two cached blocks; A again misses on the GPU, and hits both in a tier if there is one."""
    a = Sequence(A, 4)
    return [a, Sequence(B, 4), a]  # the same freed sequence, allocated again


def test_a_tier_keeps_what_the_pool_evicts_and_every_token_is_counted_once():
    no_tier = replay_through_tier(evict_then_return(), gpu_blocks=3)
    tier = replay_through_tier(evict_then_return(), gpu_blocks=3, num_offload_blocks=4)
    assert (no_tier.gpu_hit_blocks, no_tier.tier_hit_blocks, no_tier.miss_tokens) == (0, 0, 30)
    assert (tier.gpu_hit_blocks, tier.tier_hit_blocks, tier.miss_blocks) == (0, 2, 4)
    assert (tier.tier_hit_tokens, tier.miss_tokens) == (8, 22)


def test_the_sweep_has_a_no_tier_row_then_one_per_tier_and_size_with_shares_that_add_up():
    runs = tier_hit_runs(evict_then_return(), gpu_blocks=3, tiers={"LRU": ("lru", "always"), "ARC": ("arc", "always")},
                         tier_blocks=[1, 4], progress=False)
    assert list(zip(runs.tier, runs.blocks)) == [("none", 0), ("LRU", 1), ("LRU", 4), ("ARC", 1), ("ARC", 4)]
    assert runs.total_hit.iloc[0] == 0
    assert runs.set_index(["tier", "blocks"]).tier_hit["LRU", 4] == pytest.approx(8 / 30)
    assert list(runs.gpu_hit + runs.tier_hit + runs.miss) == pytest.approx([1] * 5)
    assert (runs.total_hit == runs.gpu_hit + runs.tier_hit).all()


@pytest.mark.parametrize("seqs, tiers, sizes", [
    ([], {"LRU": ("lru", "always")}, [4]),
    ([Sequence(A, 4), Sequence(B, 8)], {"LRU": ("lru", "always")}, [4]),
    (None, {}, [4]),
    (None, {"LRU": ("lru", "always")}, []),
    (None, {"LRU": ("lru", "always")}, [0]),
])
def test_bad_input_is_refused_before_any_replay(seqs, tiers, sizes):
    with pytest.raises(InvalidArgumentError):
        tier_hit_runs(evict_then_return() if seqs is None else seqs, gpu_blocks=3, tiers=tiers, tier_blocks=sizes,
                      progress=False)
