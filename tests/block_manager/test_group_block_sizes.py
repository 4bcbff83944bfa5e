"""KV cache groups of different block sizes (``group_block_sizes``): prompts are hashed once at the manager's
``block_size``, and each group's blocks are merged from those (vLLM's hybrid allocator with a
``hash_block_size``).

With whole blocks only, the hit every group serves is a multiple of every group's block size, as vLLM aligns a
hybrid hit to their least common multiple; with a ``prefix_match_unit`` it is any whole number of units, the
groups whose block the hit cuts copying its first units into a new block. The model-checking machines of
test_stateful_hybrid.py (``HybridMixed*``) read every group's K/V back after every operation.
"""

import pytest

from kvlab import AllocStatus, InvalidArgumentError, Sequence
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.manager import HybridBlockManager

FULL = FullAttentionSpec()


def _served_then_freed(manager, token_ids):
    seq = Sequence(token_ids, manager.block_size)
    manager.allocate(seq)
    tables = manager.block_tables(seq)
    manager.free(seq)
    return tables


@pytest.mark.parametrize("unit, expected", [(None, 16), (4, 28)])
def test_a_finer_unit_gives_hits_the_common_multiple_cannot(unit, expected):
    """A 16-token full-attention group and a 4-token window group: 30 shared tokens hit 16 with whole blocks
    (the multiple of 16 and 4), and 28 matched at a 4-token unit (the window's blocks whole, the full group's
    third block copied from the cached one's first 12 tokens)."""
    manager = HybridBlockManager(64, 4, groups=[FULL, SlidingWindowSpec(8)], group_block_sizes=[16, 4],
                                 prefix_match_unit=unit)
    [full, _] = _served_then_freed(manager, list(range(40)))
    seq = Sequence(list(range(30)) + [99] * 5, 4)
    hit = manager.lookup(seq)
    assert hit.num_tokens == expected and [len(hits) for hits in hit.hits] == [expected // 16, expected // 4]
    admitted = manager.allocate(seq, hit=hit)
    assert admitted.num_cached_tokens == seq.num_cached_tokens == expected
    assert admitted.copies == ([] if unit is None else [(full[1], admitted.new_blocks[0][0])])
    assert manager.stats.hit_tokens == expected
    manager.check_invariants()


def test_a_group_copies_the_first_units_of_a_block_it_holds_whole():
    """The 2-token group lost its blocks of tokens 6..9 to another request; the 4-token group still holds tokens
    4..7 whole. The hit is 6 tokens: the 4-token group takes a new block and copies tokens 4..5 from its own."""
    manager = HybridBlockManager(9, 2, groups=[FULL, FULL], group_block_sizes=[2, 4], prefix_match_unit=2)
    _, fours = _served_then_freed(manager, list(range(10)))
    other = Sequence([97, 98, 99], 2)
    manager.allocate(other)  # takes the free blocks in LRU order: an unused one, then tokens 8..9 and 6..7
    seq = Sequence(list(range(10)), 2)
    hit = manager.lookup(seq)
    assert (hit.num_tokens, hit.partial) == (6, (None, fours[1]))
    assert manager.can_allocate(seq, hit=hit) is AllocStatus.LATER  # the source is pinned: a block short
    manager.free(other)
    admitted = manager.allocate(seq, hit=hit)
    assert admitted.copies == [(fours[1], admitted.new_blocks[1][0])]
    manager.check_invariants()


def test_a_prompt_is_hashed_once_at_the_managers_block_size():
    calls = []

    def hash_fn(parent, token_ids):
        calls.append(token_ids)
        return hash((parent, token_ids))

    manager = HybridBlockManager(32, 2, groups=[FULL, FULL], group_block_sizes=[2, 6], hash_fn=hash_fn)
    seq = Sequence(list(range(13)), 2)
    manager.allocate(seq)
    for token in range(5):
        seq.append_token(token)
        manager.append_slots(seq)
    assert calls == [tuple(seq.token_ids[i:i + 2]) for i in range(0, 18, 2)]  # each 2-token block, once
    assert [len(table) for table in manager.block_tables(seq)] == [9, 3]
    manager.check_invariants()


def test_a_stale_hit_is_refused():
    manager = HybridBlockManager(6, 2, groups=[FULL, FULL], group_block_sizes=[2, 4])
    _served_then_freed(manager, list(range(5)))
    seq = Sequence(list(range(5)), 2)
    hit = manager.lookup(seq)
    assert hit.num_tokens == 4
    _served_then_freed(manager, list(range(50, 58)))  # reuses every block
    with pytest.raises(InvalidArgumentError, match="stale"):
        manager.allocate(seq, hit=hit)


@pytest.mark.parametrize("options, match", [
    (dict(group_block_sizes=[4, 6]), "multiple of block_size 4"),
    (dict(group_block_sizes=[4]), "one block size per group"),
    (dict(group_block_sizes="48"), "a list of block sizes"),
    (dict(group_block_sizes=[4, 8], use_eagle=True), "use_eagle"),
    (dict(group_block_sizes=[4, 8], kv_events=True), "kv_events"),
    (dict(groups=[FULL, SlidingWindowSpec(8)], group_block_sizes=[4, 8], prefix_match_unit=4),
     "sliding window whose blocks are larger than the unit"),
])
def test_groups_the_manager_cannot_serve_are_refused(options, match):
    options = dict(dict(groups=[FULL, FULL]), **options)
    with pytest.raises(InvalidArgumentError, match=match):
        HybridBlockManager(16, 4, **options)
