"""A hybrid manager answers the coordinator's queries a BlockManager answers, from the same code
(kvlab.blocks.manager): it used to answer a subset of them, written a second time."""

import pytest

from kvlab import BlockManager, InvalidArgumentError, Sequence, SequenceStateError
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec

from helpers import grow

BS = 4
GROUPS = [FullAttentionSpec(), SlidingWindowSpec(4)]

POOL_QUERIES = ("num_free_blocks", "num_evictions", "num_cached_blocks", "tier_stats", "num_offload_blocks",
                "num_cpu_blocks", "num_free_cpu_blocks", "usable_blocks", "groups")
BLOCK_QUERIES = ("ref_count", "block_hash", "is_cached")
SEQUENCE_QUERIES = ("get_block_table", "block_tables", "is_swapped", "num_released_blocks",
                    "num_released_blocks_per_group", "num_scheduled_tokens")


def make(num_blocks=32, **kw):
    return HybridBlockManager(num_blocks, BS, groups=GROUPS, **kw)


def answers(m, seqs) -> dict:
    """Everything the coordinator's queries say about ``m`` and its allocated ``seqs``."""
    said = {name: getattr(m, name) for name in POOL_QUERIES}
    said.update({name: [getattr(m, name)(b) for b in range(m.num_blocks)] for name in BLOCK_QUERIES})
    said["free_block_ids"] = m.free_block_ids()
    said["cpu_ref_count"] = [m.cpu_ref_count(b) for b in range(m.num_cpu_blocks)]
    said.update({name: [getattr(m, name)(seq) for seq in seqs] for name in SEQUENCE_QUERIES})
    said["slot_mappings"] = [m.slot_mappings(seq, 0, seq.num_computed_tokens) for seq in seqs if not m.is_swapped(seq)]
    said["blocks_for_prompt"] = [m.blocks_for_prompt(n, k) for n in (1, 9, 30) for k in (None, 1)]
    return said


def lifecycle(m):
    """Prefix hits, a fork, decode steps, an eviction and a swap-out; yields the live sequences after each."""
    a, b, c = Sequence(range(9), BS), Sequence(range(9), BS), Sequence([])
    m.allocate(a)
    m.allocate(b)
    m.fork(b, c)
    yield [a, b, c]
    grow(m, c, range(100, 107))
    yield [a, b, c]
    m.free(a)
    for seq in (Sequence(range(200 + 12 * k, 212 + 12 * k), BS) for k in range(6)):  # evicts cached blocks
        m.allocate(seq)
        m.free(seq)
    m.swap_out(c)
    yield [b, c]


@pytest.mark.parametrize("name", POOL_QUERIES + BLOCK_QUERIES + SEQUENCE_QUERIES
                         + ("free_block_ids", "cpu_ref_count", "slot_mappings", "blocks_for_prompt"))
def test_both_managers_answer_each_coordinator_query_with_one_implementation(name):
    assert getattr(BlockManager, name) is getattr(HybridBlockManager, name)


def test_a_one_group_hybrid_manager_answers_every_query_as_a_block_manager_does():
    """One full-attention group: the same calls leave both managers in states the queries cannot tell apart."""
    single = BlockManager(12, BS, num_cpu_blocks=16)
    hybrid = HybridBlockManager(12, BS, groups=[FullAttentionSpec()], num_cpu_blocks=16)
    for seqs, twins in zip(lifecycle(single), lifecycle(hybrid)):
        assert answers(single, seqs) == answers(hybrid, twins)
    assert single.num_evictions > 0 and single.is_swapped(seqs[1])


def test_a_hybrid_manager_answers_the_pool_queries_it_lacked():
    m = make(num_cpu_blocks=16)
    seqs = list(lifecycle(m))[-1]
    b, c = seqs
    assert sorted(m.free_block_ids()) == [block for block in range(1, 32) if m.ref_count(block) == 0]
    assert len(m.free_block_ids()) == m.num_free_blocks
    full, window = m.block_tables(b)
    assert all(m.block_hash(block) is not None for block in full[:2]) and m.block_hash(full[-1]) is None
    assert m.num_evictions > 0 and (m.tier_stats, m.num_offload_blocks) == (None, 0)
    held = len(m.get_block_table(c)) - m.num_released_blocks(c)  # swapped: a window's released entries stay null
    assert m.is_swapped(c) and m.num_cpu_blocks == 16 and m.num_free_cpu_blocks == 16 - held
    m.check_invariants()


def test_a_hybrid_manager_answers_the_sequence_queries_it_lacked():
    m = make(num_cpu_blocks=16)
    seq = Sequence(range(9), BS)
    m.allocate(seq)
    assert not m.is_swapped(seq) and m.num_released_blocks(seq) == 0  # released at a later step's start
    grow(m, seq, range(100, 104))  # the last step's query sits at 12: window 4 sees 9 on, blocks 0 and 1 left it
    # Every group's released entries together: the null blocks of get_block_table.
    assert m.num_released_blocks(seq) == 2 == m.get_block_table(seq).count(0)
    full, window = m.block_tables(seq)
    assert window[:2] == [0, 0] and 0 not in full
    m.swap_out(seq)
    assert m.is_swapped(seq)
    cpu_tables = m.block_tables(seq)
    assert all(m.cpu_ref_count(block) == 1 for table in cpu_tables for block in table if block)
    m.swap_in(seq)
    assert not m.is_swapped(seq)
    m.free(seq)
    for query in (m.is_swapped, m.num_released_blocks):
        with pytest.raises(SequenceStateError, match="not allocated"):
            query(seq)
    m.check_invariants()


def test_get_num_cached_tokens_answers_for_allocated_sequences_as_a_block_managers_does():
    hybrid, single = make(), BlockManager(32, BS)
    for m in (hybrid, single):
        seq = Sequence(range(13), BS)
        assert m.get_num_cached_tokens(seq) == 0
        m.allocate(seq)
        assert m.get_num_cached_tokens(seq) == 12              # its own sealed blocks: all but the last token
        assert m.get_num_cached_tokens(Sequence(range(9), BS)) == 8
        assert m.get_num_cached_tokens(Sequence([], BS)) == 0
        m.check_invariants()
    with pytest.raises(InvalidArgumentError, match="block_size"):
        hybrid.get_num_cached_tokens(Sequence(range(9), BS + 1))


def test_each_groups_released_entries_are_counted_on_the_gpu_and_in_the_cpu_pool():
    """The count, not the value 0, tells a window's released entries: a swapped-out table's CPU block 0 is real."""
    m = make(num_cpu_blocks=16)
    seq = Sequence(range(9), BS)
    m.allocate(seq)
    assert m.num_released_blocks_per_group(seq) == [0, 0]
    grow(m, seq, range(100, 104))  # the query at 12 sees 9 on: the window group released its blocks 0 and 1
    assert m.num_released_blocks_per_group(seq) == [0, 2]
    assert sum(m.num_released_blocks_per_group(seq)) == m.num_released_blocks(seq)
    m.swap_out(seq)
    full, window = m.block_tables(seq)
    assert full[0] == 0 and window[:2] == [0, 0]  # CPU block 0 (the full group's) and two null entries read alike
    assert m.num_released_blocks_per_group(seq) == [0, 2]
    m.free(seq)
    with pytest.raises(SequenceStateError, match="not allocated"):
        m.num_released_blocks_per_group(seq)
    m.check_invariants()
