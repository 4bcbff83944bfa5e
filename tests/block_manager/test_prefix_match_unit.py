"""prefix_match_unit (vLLM's hash_block_size): the prefix cache matches at a unit finer than the block.

vLLM issue #40696: a 528-token block (a hybrid model's page) gives no hit to a prompt shorter than a block,
since no block of it is ever full. With a 16-token unit, the same prompt sent again hits its whole units: the
manager gives the new sequence a new block and returns the copy of the cached block's first units.
"""

import random

import pytest

from kvlab import AllocStatus, BlockManager, InvalidArgumentError, InvariantViolation, Sequence
from kvlab.blocks.kv_cache_groups import FullAttentionSpec
from kvlab.blocks.manager import HybridBlockManager
from test_stateful import StackPolicy


def _run_and_free(manager, token_ids, block_size):
    seq = Sequence(token_ids, block_size)
    manager.allocate(seq)
    manager.free(seq)
    return seq


def test_a_prompt_shorter_than_a_block_hits_after_the_same_prompt():
    manager = BlockManager(8, 528, prefix_match_unit=16)
    first = Sequence(list(range(300)), 528)
    [[source]] = manager.allocate(first).new_blocks
    manager.free(first)
    again = Sequence(list(range(300)), 528)
    hit = manager.lookup(again)
    assert (hit.num_tokens, hit.num_partial_tokens, hit.partial) == (288, 288, (source,))
    admitted = manager.allocate(again, hit=hit)
    [[block]] = admitted.new_blocks
    assert block != source and admitted.copies == [(source, block)]
    assert (again.num_cached_tokens, again.num_computed_tokens) == (288, 300)
    assert manager.ref_count(source) == 0  # copied, not shared: the hit keeps no reference to it
    manager.check_invariants()


def test_the_default_unit_is_the_block_and_finds_no_partial_block():
    manager = BlockManager(8, 528)
    _run_and_free(manager, list(range(300)), 528)
    assert manager.prefix_match_unit == 528
    assert manager.lookup(Sequence(list(range(300)), 528)).num_tokens == 0


def test_a_partial_hit_follows_the_whole_blocks_and_leaves_the_last_token_to_compute():
    manager = BlockManager(16, 8, prefix_match_unit=2)
    _run_and_free(manager, list(range(21)), 8)   # two full blocks, then 5 tokens: 2 whole units
    hit = manager.lookup(Sequence(list(range(21)), 8))
    assert (hit.num_tokens, hit.num_partial_tokens) == (20, 4)
    # the same 20 tokens as a whole prompt: the last one is computed, so one unit of the third block hits
    hit = manager.lookup(Sequence(list(range(20)), 8))
    assert (hit.num_tokens, hit.num_partial_tokens) == (18, 2)
    # another third block: the whole blocks hit, the partial block does not
    hit = manager.lookup(Sequence(list(range(16)) + [99] * 5, 8))
    assert (hit.num_tokens, hit.num_partial_tokens, hit.partial) == (16, 0, ())


def test_a_partial_hit_needs_the_same_prefix_before_the_block():
    manager = BlockManager(16, 8, prefix_match_unit=2)
    _run_and_free(manager, list(range(13)), 8)
    other_prefix = [99] + list(range(1, 13))  # the same second block's tokens after another first block
    assert manager.lookup(Sequence(other_prefix, 8)).num_tokens == 0
    salted = Sequence(list(range(13)), 8, cache_salt="tenant")
    assert manager.lookup(salted).num_tokens == 0


def test_a_running_prompt_is_found_once_its_step_ran():
    """A partial entry is made at the sequence's next call (its step ran): a copy made before that step's
    writes would copy nothing."""
    manager = BlockManager(16, 8, prefix_match_unit=2)
    running = Sequence(list(range(5)), 8)
    manager.allocate(running)
    assert manager.lookup(Sequence(list(range(5)), 8)).num_tokens == 0  # its step has not run yet
    running.append_token(7)
    manager.append_slots(running)
    assert manager.lookup(Sequence(list(range(5)), 8)).num_tokens == 4
    manager.check_invariants()


def test_a_hybrid_manager_hits_the_units_every_group_holds():
    manager = HybridBlockManager(16, 8, groups=[FullAttentionSpec(), FullAttentionSpec()], prefix_match_unit=2)
    _run_and_free(manager, list(range(13)), 8)
    seq = Sequence(list(range(13)), 8)
    hit = manager.lookup(seq)
    assert hit.num_tokens == 12 and len(hit.partial) == 2
    admitted = manager.allocate(seq, hit=hit)
    assert len(admitted.copies) == 2
    manager.check_invariants()


def test_no_group_is_handed_another_groups_partial_source():
    """A stack policy reuses the last freed block first: group 1's partial source, freed last, would be group 0's
    new block, and the copies a swap that no copy kernel can apply. The sources are pinned while groups take
    their blocks, so every copy reads a block nobody writes, and it costs the pool those blocks at admission."""
    for num_blocks, fits in ((6, False), (8, True)):
        manager = HybridBlockManager(num_blocks, 4, groups=[FullAttentionSpec(), FullAttentionSpec()],
                                     prefix_match_unit=1, eviction=StackPolicy())
        _run_and_free(manager, list(range(10)), 4)
        seq = Sequence(list(range(9)) + [50, 51], 4)
        hit = manager.lookup(seq)
        assert hit.num_tokens == 9 and None not in hit.partial
        if not fits:  # 4 hits, 2 new blocks and the 2 sources they must not reuse
            assert manager.can_allocate(seq, hit=hit) is not AllocStatus.OK
            continue
        copies = manager.allocate(seq, hit=hit).copies
        sources, targets = {src for src, _ in copies}, {dst for _, dst in copies}
        assert len(copies) == 2 and not sources & targets
        assert sources == set(hit.partial)
        manager.check_invariants()


def test_a_stale_partial_hit_is_refused():
    manager = BlockManager(3, 8, prefix_match_unit=2)
    _run_and_free(manager, list(range(5)), 8)
    seq = Sequence(list(range(5)), 8)
    hit = manager.lookup(seq)
    assert hit.num_partial_tokens == 4
    filler = [Sequence([50 + i] * 8, 8) for i in range(3)]  # takes every block: the hit's block is reused
    for other in filler:
        manager.allocate(other)
    for other in filler:
        manager.free(other)
    with pytest.raises(InvalidArgumentError, match="stale"):
        manager.allocate(seq, hit=hit)


def test_the_invariant_checker_reads_partial_entries():
    manager = BlockManager(8, 8, prefix_match_unit=2)
    seq = Sequence(list(range(5)), 8)
    manager.allocate(seq)
    seq.append_token(7)
    manager.append_slots(seq)
    manager.check_invariants()
    index = manager._pool.index
    [(block, (group, parent, suffix, held, owned))] = index.partial_of.items()
    index.partial_of[block] = (group, parent, suffix, b"\0" * len(held), owned)  # other tokens than the sequence's
    with pytest.raises(InvariantViolation):
        manager.check_invariants()


def test_units_indexed_after_a_block_swapped_back_in_chain_after_its_content():
    """A sequence swapped back in holds its blocks again without sealed content (not re-registered), yet the block
    it seals next chains after its prefix's content. Another sequence that hits that block indexes its units after
    the same content: sound (a hit copies the right K/V), and the checker, which finds no content in the block
    before, checks the entry's parent against the block's own sealed parent instead."""
    manager = BlockManager(24, 4, num_cpu_blocks=12, prefix_match_unit=1)
    first = Sequence([1, 2, 3, 1, 2], 4)
    manager.allocate(first)
    manager.swap_out(first)
    manager.swap_in(first)
    for token in (0, 0, 0, 5):  # seals [2, 0, 0, 0] after the swapped-in [1, 2, 3, 1]
        first.append_token(token)
        manager.append_slots(first)
    second = Sequence([1, 2, 3, 1, 2, 0, 0, 0, 9], 4)
    manager.allocate(second)
    shared = first.block_table[1]
    assert second.num_cached_tokens == 8 and second.block_table[1] == shared
    second.append_token(4)
    manager.append_slots(second)  # indexes the units of second's blocks, the shared one included
    manager.check_invariants()
    third = Sequence([1, 2, 3, 1, 2, 0, 7], 4)
    hit = manager.lookup(third)
    assert (hit.num_tokens, hit.partial) == (6, (shared,))  # [2, 0] found in the shared block, after [1, 2, 3, 1]
    index = manager._pool.index
    group, parent, suffix, held, owned = index.partial_of[shared]
    index.partial_of[shared] = (group, parent + 1, suffix, held, owned)  # after another prefix than the block's
    with pytest.raises(InvariantViolation, match=f"sequence {first.seq_id}: block 1"):
        manager.check_invariants()


@pytest.mark.parametrize("options, match", [
    (dict(block_size=8, prefix_match_unit=3), "must divide"),
    (dict(block_size=8, prefix_match_unit=16), "prefix_match_unit"),
    (dict(block_size=8, prefix_match_unit=0), "prefix_match_unit"),
    (dict(block_size=8, prefix_match_unit=2, sliding_window=8), "sliding window"),
    (dict(block_size=8, prefix_match_unit=2, num_offload_blocks=4), "offload tier"),
    (dict(block_size=8, prefix_match_unit=2, use_eagle=True), "use_eagle"),
])
def test_a_unit_the_manager_cannot_serve_is_refused(options, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BlockManager(16, **options)


def _program(manager, rng, block_size):
    """Random admissions (with chunks), steps and frees; returns everything the manager answered."""
    answers, running = [], []
    vocab = [list(rng.choice(range(3)) for _ in range(rng.randint(1, 20))) for _ in range(6)]
    for _ in range(120):
        op = rng.random()
        if op < 0.45 or not running:
            seq = Sequence(rng.choice(vocab) + [rng.randrange(3) for _ in range(rng.randint(0, 6))], block_size)
            hit = manager.lookup(seq)
            answers.append(("hit", hit.num_tokens, hit.hits, hit.num_partial_tokens))
            if manager.can_allocate(seq, hit=hit).name == "OK":
                admitted = manager.allocate(seq, hit=hit)
                answers.append(("admitted", admitted, admitted.copies))
                running.append(seq)
        elif op < 0.8:
            seq = rng.choice(running)
            seq.append_token(rng.randrange(3))
            if manager.can_append_slots(seq):
                answers.append(("copies", list(manager.append_slots(seq))))
        else:
            seq = running.pop(rng.randrange(len(running)))
            manager.free(seq, preempted=rng.random() < 0.3)
        answers.append(("state", manager.free_block_ids(), manager.num_cached_blocks,
                        [manager.get_block_table(seq) for seq in running]))
    manager.check_invariants()
    return answers


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_a_unit_of_one_block_behaves_exactly_as_without_a_unit(seed, eviction):
    """The law: prefix_match_unit=block_size is today's manager, answer for answer."""
    runs = [_program(BlockManager(12, 4, eviction=eviction, **options), random.Random(seed), 4)
            for options in ({}, {"prefix_match_unit": 4})]
    assert runs[0] == runs[1]
