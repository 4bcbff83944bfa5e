"""The CPU offload tier (kvlab.blocks.tiers): evicted cached blocks are kept, a GPU miss that hits the tier
is promoted with a CPU -> GPU copy, verified like a GPU hit; failed calls change nothing; ARC and the reuse filter
behave as vLLM's; KV events carry the medium; counters per tier."""

import random
from collections import OrderedDict

import pytest
from helpers import TierMoves, snapshot

from kvlab import BlockManager, EvictionPolicy, InvalidArgumentError, OutOfBlocksError, Sequence
from kvlab.blocks import TierMove
from kvlab.blocks.events import BlockRemoved, BlockStored, CachedHashes
from kvlab.blocks.prefix_cache import PrefixIndex
from kvlab.blocks.tiers import REUSE_THRESHOLD, ARCOrder, LRUOrder, ReuseFilter
from kvlab.errors import EvictionPolicyError, InvariantViolation

SYSTEM = [1, 2, 3, 4, 5, 6]  # a shared system prompt: three blocks of 2


def evict_everything(m, n=9):
    """Run an unrelated prompt through the pool, so every free cached block is reused (evicted)."""
    other = Sequence([7] * n, m.block_size)
    m.allocate(other)
    m.free(other)


def test_an_evicted_prompt_is_offloaded_then_promoted_back_with_copies_in_order():
    m = BlockManager(5, block_size=2, num_offload_blocks=4)
    tier_moves = TierMoves(m)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    table = list(first.block_table)
    m.free(first)
    evict_everything(m)
    offloads = tier_moves.take()
    assert sorted(gpu for _, gpu, _ in offloads) == table[:3] and {k for k, _, _ in offloads} == {"offload"}
    slot_of = {gpu: slot for _, gpu, slot in offloads}
    again = Sequence(SYSTEM + [9], 2)
    assert m.get_num_cached_tokens(again) == 6
    m.allocate(again)
    moves = tier_moves.take()
    promotes = [(src, dst) for kind, src, dst in moves if kind == "promote"]
    assert promotes == [(slot_of[gpu], new) for gpu, new in zip(table[:3], again.block_table[:3])]
    # Every offload of a block this call promotes into comes before the promotion that overwrites it.
    for i, (kind, src, dst) in enumerate(moves):
        if kind == "promote":
            assert not any(k == "offload" and g == dst for k, g, _ in moves[i:])
    assert again.num_cached_tokens == 6 and tier_moves.take() == []
    stats = m.tier_stats
    assert (stats.gpu_hit_blocks, stats.tier_hit_blocks, stats.tier_hit_tokens) == (0, 3, 6)
    m.check_invariants()
    third = Sequence(SYSTEM + [10], 2)      # the promoted blocks are GPU hits now
    m.allocate(third)
    assert third.block_table[:3] == again.block_table[:3]
    assert "promote" not in {kind for kind, _, _ in tier_moves.take()}
    assert m.tier_stats.gpu_hit_blocks == 3


def test_a_call_returns_its_tier_copies_in_batches_one_per_run_of_a_kind():
    m = BlockManager(5, block_size=2, num_offload_blocks=4)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    other = Sequence([7] * 9, 2)
    assert m.allocate(other).tier_moves == [TierMove("offload", [2, 1, 0], [0, 1, 2])]  # the LRU order of free
    m.free(other)
    moves = m.allocate(Sequence(SYSTEM + [9], 2)).tier_moves
    # Room for the promotions offloads two of other's blocks; the tier's one unpinned slot takes both in turn (the
    # later copy wins: applied in order); the last offload reuses a slot just promoted from.
    assert moves == [TierMove("offload", [1, 2], [3, 3]), TierMove("promote", [2, 1, 0], [0, 1, 2]),
                     TierMove("offload", [3], [0])]
    m.check_invariants()


def test_a_tier_hit_is_verified_like_a_gpu_hit_bytes_keys_and_parent():
    always_7 = lambda parent, ids: 7  # noqa: E731: every block has the same hash
    m = BlockManager(5, block_size=2, num_offload_blocks=4, hash_fn=always_7)
    tier_moves = TierMoves(m)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    tier_moves.take()
    for other in (Sequence([9, 9] + SYSTEM[2:] + [8], 2), Sequence(SYSTEM + [8], 2, cache_salt="tenant-b")):
        assert m.get_num_cached_tokens(other) == 0
    m.check_invariants()


def test_blocks_sealed_after_a_promoted_block_chain_to_it():
    m = BlockManager(5, block_size=2, num_offload_blocks=4)
    first = Sequence(SYSTEM[:2] + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    longer = Sequence(SYSTEM + [8], 2)     # block 0 from the tier, blocks 1 and 2 computed after it
    m.allocate(longer)
    assert m.tier_stats.tier_hit_blocks == 1
    m.check_invariants()
    m.free(longer)
    assert m.get_num_cached_tokens(Sequence(SYSTEM + [9], 2)) == 6


class FailingOnPop(EvictionPolicy):
    """LRU-ish, but pop() raises when told to."""

    def __init__(self):
        self.free, self.fail = {}, False

    def add(self, block_id, cached):
        self.free[block_id] = None

    def remove(self, block_id):
        del self.free[block_id]

    def pop(self):
        if self.fail:
            raise RuntimeError("policy bug")
        block = next(iter(self.free))
        del self.free[block]
        return block

    def __iter__(self):
        return iter(list(self.free))

    def __len__(self):
        return len(self.free)


def _tier_state(m):
    tier = m._tier
    return (list(tier.index.cached.items()), tier.order.resident(), tier.num_free,
            [(move.kind, list(move.sources), list(move.targets)) for move in tier.moves],
            vars(m.tier_stats).copy())


@pytest.mark.parametrize("failure", ["no room", "policy raises"])
def test_a_failed_allocate_with_tier_hits_changes_nothing(failure):
    policy = FailingOnPop()
    m = BlockManager(5, block_size=2, num_offload_blocks=4, eviction=policy)
    tier_moves = TierMoves(m)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    tier_moves.take()
    if failure == "no room":
        m.allocate(Sequence([5] * 5, 2))        # holds 3 of the 5 blocks: the 4 the prompt needs are not free
    else:
        policy.fail = True
    before, tier_before = snapshot(m), _tier_state(m)
    again = Sequence(SYSTEM + [9], 2)
    with pytest.raises(OutOfBlocksError if failure == "no room" else EvictionPolicyError):
        m.allocate(again)
    assert snapshot(m) == before and _tier_state(m) == tier_before
    m.check_invariants()


def test_reused_admission_keeps_only_blocks_looked_up_twice():
    m = BlockManager(4, block_size=2, num_offload_blocks=4, offload_admission="reused")
    tier_moves = TierMoves(m)
    hashes = []
    for tokens in ([1, 2, 3], [4, 5, 6], [4, 5, 6]):   # the first block of [4, 5, 6] is looked up twice
        seq = Sequence(tokens, 2)
        m.allocate(seq)
        hashes.append(m.block_hash(seq.block_table[0]))
        m.free(seq)
    evict_everything(m, 7)
    kept = {m._tier.index.hash[slot] for _, _, slot in tier_moves.take()}
    assert kept == {hashes[1]} != {hashes[0]}


def test_arc_moves_a_second_hit_to_t2_and_adapts_its_target_on_ghost_hits():
    arc = ARCOrder(capacity=2)
    arc.insert("a")
    arc.insert("b")
    arc.touch(["a"])                          # hit again: recent -> frequent
    assert list(arc.t1) == ["b"] and list(arc.t2) == ["a"]
    assert arc.victim(pinned=frozenset()) == "b" and list(arc.b1) == ["b"]   # T1 at/above its target (0)
    arc.touch(["b"])                          # a hit in B1: recency was undervalued
    assert arc.target_t1 == 1
    arc.insert("b")                           # stored again: back in T1, out of the ghost list
    assert list(arc.t1) == ["b"] and not arc.b1
    assert arc.victim(pinned=frozenset({"b"})) == "a" and list(arc.b2) == ["a"]  # a pinned entry is never dropped
    arc.touch(["a"])                          # a hit in B2: frequency was undervalued
    assert arc.target_t1 == 0
    arc.check()


def test_lru_drops_the_least_recently_used_entry_but_never_a_pinned_one():
    index = PrefixIndex(3, name="CPU slot")
    lru = LRUOrder(capacity=3, index=index)   # the order of the tier index's own map: the tier inserts and pops
    for slot, h in enumerate("abc"):
        index.cached[h] = slot
    lru.touch(["b", "a"])                     # a prompt's blocks, visited last to first: its first ends most recent
    assert lru.resident() == ["c", "a", "b"] and index.cached == {"c": 2, "a": 0, "b": 1}
    assert lru.victim(pinned=frozenset({"c"})) == "a" and lru.victim(pinned=frozenset("cab")) is None
    lru.reorder(["b", "c", "a"])              # a learner's order: the same map, slots kept
    assert list(index.cached.items()) == [("b", 1), ("c", 2), ("a", 0)]


def test_tier_kv_events_carry_the_medium_and_rebuild_both_tiers():
    m = BlockManager(5, block_size=2, num_offload_blocks=2, kv_events=True)
    index = CachedHashes()
    events = []
    m.kv_events.subscribe(index)
    m.kv_events.subscribe(events.append)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    cpu_events = [e for e in events if e.medium == "CPU"]
    assert cpu_events and {type(e) for e in cpu_events} <= {BlockStored, BlockRemoved}
    assert all(e.parent_block_hash is None for e in cpu_events if type(e) is BlockStored)
    assert index.cpu_hashes == set(m._tier.index.cached)
    assert index.hashes == {m.block_hash(b) for b in range(m.num_blocks) if m.is_cached(b)}
    m.reset_prefix_cache()
    assert not index.cpu_hashes and not m._tier.index.cached and m.tier_stats.offloaded_blocks == 0


def test_the_teaching_log_shows_offloads_and_promotions():
    m = BlockManager(5, block_size=2, num_offload_blocks=4, record_events=True)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    m.allocate(Sequence(SYSTEM + [9], 2))
    kinds = [e.kind for e in m.events]
    assert "offload" in kinds and "promote" in kinds
    assert kinds.index("offload") < kinds.index("promote")


def test_check_invariants_sees_a_content_id_that_means_two_prefixes_across_tiers():
    m = BlockManager(5, block_size=2, num_offload_blocks=4)
    tier_moves = TierMoves(m)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    m.allocate(Sequence(SYSTEM + [9], 2))     # promoted: each block's content id is now in both tiers
    m.check_invariants()
    slot = next(src for kind, src, _ in tier_moves.take() if kind == "promote")
    m._tier.index.block_bytes[slot] += b"other tenant"
    with pytest.raises(InvariantViolation, match="content id"):
        m.check_invariants()


@pytest.mark.parametrize("options, match", [
    (dict(num_offload_blocks=-1), "num_offload_blocks"),
    (dict(num_offload_blocks=4, offload_policy="mru"), "offload_policy"),
    (dict(num_offload_blocks=4, offload_policy=["lru"]), r"offload_policy must be one of \['arc', 'lru'\]"),
    (dict(num_offload_blocks=4, offload_admission="never"), "offload_admission"),
    (dict(num_offload_blocks=4, sliding_window=4), "sliding_window"),
    (dict(num_offload_blocks=4, enable_prefix_caching=False), "prefix caching"),
])
def test_bad_tier_options_are_refused_clearly(options, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BlockManager(8, block_size=2, **options)


def test_without_a_tier_nothing_changes():
    m = BlockManager(5, block_size=2)
    tier_moves = TierMoves(m)
    first = Sequence(SYSTEM + [8], 2)
    m.allocate(first)
    m.free(first)
    evict_everything(m)
    assert tier_moves.take() == [] and m.tier_stats is None and m.num_evictions == 3


@pytest.mark.parametrize("seed", range(20))
def test_the_reuse_filter_counts_as_vllms_lru_table(seed):
    """Its whole-batch path (and the halves it splits a batch into) against an OrderedDict table as vLLM's
    FilterReusedOffloadingManager keeps it: full tables, repeated hashes within a batch, old hashes near the front."""
    rng = random.Random(seed)
    table, reference = ReuseFilter(max_entries=rng.choice([1, 3, 8])), OrderedDict()
    for _ in range(200):
        hashes = [rng.randrange(12) for _ in range(rng.randrange(0, 10))]
        if rng.random() < 0.7:
            hashes = list(dict.fromkeys(hashes))  # a prompt's chained hashes are distinct but for collisions
        table.record(hashes)
        for h in hashes:
            if h in reference:
                reference.move_to_end(h)
                reference[h] += 1
            else:
                if len(reference) >= table.max_entries:
                    reference.popitem(last=False)
                reference[h] = 1
        assert list(table.counts.items()) == list(reference.items())
        assert table.reused == {h for h, count in reference.items() if count >= REUSE_THRESHOLD}
