"""The rest of vLLM V0's block-space-manager interface: encoder-decoder cross tables, computed blocks, recency
touches, cached-token counts, hit rates and three-way swap answers."""

import pytest

from kvlab import AllocStatus, InvalidArgumentError, InvariantViolation, Sequence, SequenceStateError
from kvlab.blocks.vllm_v0 import BlockSpaceManager as BlockManager

from helpers import allocated, grow, snapshot


def _encoder_decoder(manager, decoder_tokens, encoder_tokens):
    seq = Sequence(decoder_tokens, manager.block_size)
    manager.allocate(seq, encoder_seq=Sequence(encoder_tokens, manager.block_size))
    return seq


def test_cross_table_holds_the_encoder_tokens_and_is_never_cached():
    m = BlockManager(16, block_size=4)
    seq = _encoder_decoder(m, [1, 2, 3], range(10))
    cross = m.get_cross_block_table(seq)
    assert len(cross) == 3 and not set(cross) & set(seq.block_table)
    assert all(m.ref_count(b) == 1 and not m.is_cached(b) for b in cross)
    other = _encoder_decoder(m, [1, 2, 3], range(10))     # the same encoder tokens: no sharing
    assert not set(m.get_cross_block_table(other)) & set(cross)
    m.check_invariants()


def test_admission_counts_the_encoder_blocks():
    m = BlockManager(6, block_size=4)
    decoder, encoder = Sequence([1, 2, 3], 4), Sequence(range(16), 4)    # 1 + 4 blocks
    assert m.can_allocate(decoder, encoder_seq=encoder) is AllocStatus.OK
    assert m.can_allocate(decoder, encoder_seq=Sequence(range(21), 4)) is AllocStatus.NEVER   # 1 + 6 > 6
    blocker = allocated(m, [9] * 5)                    # 2 blocks: 4 left, 5 needed
    assert m.can_allocate(decoder, encoder_seq=encoder) is AllocStatus.LATER
    before = snapshot(m)
    with pytest.raises(Exception, match="free blocks"):
        m.allocate(decoder, encoder_seq=encoder)
    assert snapshot(m) == before
    m.free(blocker)
    m.allocate(decoder, encoder_seq=encoder)
    assert m.num_free_blocks == 1


def test_forks_share_the_cross_table_and_it_moves_with_the_last_one_on_the_gpu():
    m = BlockManager(16, block_size=4, num_cpu_blocks=16)
    parent = _encoder_decoder(m, [1, 2, 3, 4, 5], range(8))
    cross = m.get_cross_block_table(parent)
    child = Sequence([])
    m.fork(parent, child)
    assert m.get_cross_block_table(child) == cross and all(m.ref_count(b) == 1 for b in cross)
    out = m.swap_out(parent)                          # the child still reads the cross blocks on the GPU
    assert not {g for g, _ in out} & set(cross) and m.get_cross_block_table(child) == cross
    out = m.swap_out(child)                           # the last member leaves: the cross blocks go too
    assert set(cross) <= {g for g, _ in out} and m.num_free_blocks == 16
    cpu_cross = m.get_cross_block_table(parent)
    assert all(m.cpu_ref_count(c) == 1 for c in cpu_cross)
    back = m.swap_in(parent)                          # the first one back brings them back
    assert set(cpu_cross) <= {c for c, _ in back}
    m.swap_in(child)
    assert m.get_cross_block_table(child) == m.get_cross_block_table(parent)
    m.check_invariants()


def test_free_cross_and_reattach_after_recompute_preemption():
    m = BlockManager(16, block_size=4)
    seq = _encoder_decoder(m, [1, 2, 3], range(8))
    cross = m.get_cross_block_table(seq)
    m.free(seq, preempted=True)                      # the encoder's output outlives the preemption
    assert all(m.ref_count(b) == 1 for b in cross)
    m.allocate(seq)                                   # re-allocation reattaches it
    assert m.get_cross_block_table(seq) == cross
    m.free(seq)                                       # finished: the table stays until free_cross
    with pytest.raises(SequenceStateError, match="already has a cross-attention table"):
        m.allocate(seq, encoder_seq=Sequence([1], 4))
    m.free_cross(seq)                                 # callable with the root after it was freed
    assert all(m.ref_count(b) == 0 for b in cross) and m.num_free_blocks == 16
    with pytest.raises(SequenceStateError, match="no cross-attention table"):
        m.get_cross_block_table(seq)
    m.check_invariants()


def test_bad_encoder_sequences():
    m = BlockManager(16, block_size=4)
    for encoder, match in ((Sequence([1, 2], 8), "block_size 4"), (Sequence([], 4), "must have tokens"),
                           ([1, 2], "kvlab.Sequence")):
        before = snapshot(m)
        with pytest.raises(InvalidArgumentError, match=match):
            m.allocate(Sequence([1], 4), encoder_seq=encoder)
        assert snapshot(m) == before


def test_common_computed_blocks_of_a_group():
    m = BlockManager(16, block_size=2)
    parent = allocated(m, range(7))
    assert m.get_common_computed_block_ids([parent]) == []       # nothing computed before the step runs
    m.mark_blocks_as_computed(parent)
    child = Sequence([])
    m.fork(parent, child)
    assert m.get_common_computed_block_ids([parent, child]) == list(parent.block_table[:3])
    grow(m, child, [50, 51])                          # copies the shared partial block, then fills it
    m.mark_blocks_as_computed(child)
    assert m.get_common_computed_block_ids([parent, child]) == list(parent.block_table[:3])
    hit = allocated(m, list(range(5)) + [9])          # a prefix hit counts as computed at once
    assert m.get_common_computed_block_ids([parent, hit]) == list(parent.block_table[:2])


def test_a_touched_block_outlives_an_untouched_one_of_the_same_age():
    for touched in (False, True):
        m = BlockManager(4, block_size=2)
        a, b = allocated(m, [1, 2, 3]), allocated(m, [7, 8, 9])   # same age: allocated together
        if touched:
            m.access_all_blocks_in_seq(a, now=10.0)
        m.free(a)                                        # a is freed first...
        m.free(b)
        allocated(m, [5, 5, 5, 5, 5])                    # 3 blocks: both partial ones and one full one
        survivor = [seq for seq in (a, b) if m.get_num_cached_tokens(Sequence(seq.token_ids, 2))]
        # ...so without touches LRU evicts a's full block first; touched at 10.0, a's block is kept.
        assert survivor == ([a] if touched else [b])


def test_num_cached_tokens_and_hit_rate():
    m = BlockManager(16, block_size=4)
    allocated(m, range(10))
    waiting = Sequence(list(range(8)) + [99, 98], 4)
    assert m.get_num_cached_tokens(waiting) == 8
    m.allocate(waiting)
    assert waiting.num_cached_tokens == 8
    assert m.get_prefix_cache_hit_rate("gpu") == 2 / 4 and m.get_prefix_cache_hit_rate("cpu") == -1.0
    assert m.num_cached_blocks == 2 == sum(map(m.is_cached, range(m.num_blocks)))
    assert BlockManager(4, enable_prefix_caching=False).get_prefix_cache_hit_rate("gpu") == -1.0
    with pytest.raises(InvalidArgumentError, match="'gpu' or 'cpu'"):
        m.get_prefix_cache_hit_rate("tpu")


def test_swap_answers_are_three_way():
    m = BlockManager(4, block_size=4, num_cpu_blocks=2)
    small, big = allocated(m, range(4)), allocated(m, range(10, 19))
    assert m.can_swap_out(big) is AllocStatus.NEVER          # 3 blocks, 2 CPU blocks in all
    assert m.can_swap_out(small) is AllocStatus.OK
    m.swap_out(small)
    m.free(big)
    m.allocate(Sequence(range(30, 46), 4))                   # fills the GPU
    assert m.can_swap_in(small) is AllocStatus.LATER


def test_answers_are_false_unless_ok_so_vllm_style_ifs_stay_safe():
    """vLLM's can_swap_out is a bool: ``if m.can_swap_out(s): m.swap_out(s)`` must not go ahead on NEVER."""
    assert [bool(s) for s in AllocStatus] == [True, False, False]
    m = BlockManager(4, block_size=4, num_cpu_blocks=2)
    small, big = allocated(m, range(4)), allocated(m, range(10, 19))
    swapped = [seq for seq in (big, small) if m.can_swap_out(seq) and m.swap_out(seq) is not None]
    assert swapped == [small] and not m.is_swapped(big)
    assert not m.can_allocate(Sequence(range(100), 4))        # NEVER
    m.free(big)
    m.allocate(Sequence(range(30, 46), 4))                    # fills the GPU: swap-in is LATER
    assert m.can_swap_in(small) is AllocStatus.LATER and not m.can_swap_in(small)


@pytest.mark.parametrize("seqs", [None, "abc", 3, {1: 2}])
def test_common_computed_block_ids_wants_a_list(seqs):
    m = BlockManager(8, block_size=4)
    with pytest.raises(InvalidArgumentError, match="list of Sequence"):
        m.get_common_computed_block_ids(seqs)


def test_common_computed_block_ids_refuses_a_bare_sequence():
    m = BlockManager(8, block_size=4)
    seq = allocated(m, range(8))
    with pytest.raises(InvalidArgumentError, match=r"list of Sequence \(e.g. \[seq\]\)"):
        m.get_common_computed_block_ids(seq)
    assert m.get_common_computed_block_ids([]) == [] and m.get_common_computed_block_ids((seq,)) == []


def test_check_invariants_audits_the_computed_marks():
    m = BlockManager(8, block_size=4)
    seq = allocated(m, range(6))
    m.mark_blocks_as_computed(seq)
    m.check_invariants()
    m._computed[seq.seq_id] = 9  # more than the 6 positions scheduled
    with pytest.raises(InvariantViolation, match="marked computed"):
        m.check_invariants()
