"""Sliding windows: a block leaves the window only once no query of the current step can see it, and
only blocks whose every slot was written become prefix hits."""

from kvlab import AllocStatus, BlockManager, Sequence

from helpers import allocated


def test_a_multi_token_step_never_seals_a_block_it_does_not_write():
    # The example: 4 tokens appended before one append_slots, window 2, block size 4.
    m = BlockManager(8, block_size=4, sliding_window=2)
    a = allocated(m, [10, 11, 12])
    for t in (13, 14, 15, 16):
        a.append_token(t)
    m.append_slots(a)
    slots = m.slot_mapping(a, 3, 7)
    assert -1 not in slots                  # position 3 is this step's first query: it gets written
    b = allocated(m, [10, 11, 12, 13, 99])  # hits a's first block, whose 4 slots were all written
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0] == slots[0] // 4


def test_blocks_leave_the_window_at_the_next_step_not_during_their_own():
    m = BlockManager(16, block_size=8, sliding_window=8)
    seq = allocated(m, range(40))           # the prefill's first query (position 0) sees key 0
    assert m.num_released_blocks(seq) == 0 and -1 not in m.slot_mapping(seq, 0, 40)
    seq.append_token(40)
    m.append_slots(seq)                     # decode at position 40 sees keys 33..40: blocks 0..3 go
    assert m.num_released_blocks(seq) == 4
    assert m.slot_mapping(seq, 0, 41)[:32] == [-1] * 32 and -1 not in m.slot_mapping(seq, 33, 41)
    m.check_invariants()


def test_a_prefix_hit_keeps_the_blocks_its_first_query_sees():
    m = BlockManager(16, block_size=4, sliding_window=6)
    first = allocated(m, range(17))
    second = allocated(m, list(range(17)) + [99])  # hits 4 blocks: its first query (16) sees keys 11..16
    assert second.num_cached_tokens == 16
    assert m.num_released_blocks(second) == 2      # blocks 0 and 1 (keys 0..7) are never needed
    assert second.block_table[2:4] == first.block_table[2:4]
    assert -1 not in m.slot_mapping(second, 11, 18)


def test_admission_counts_every_block_the_step_needs():
    m = BlockManager(6, block_size=4, sliding_window=4)
    assert m.can_allocate(Sequence(range(20), 4)) is AllocStatus.OK       # 5 blocks for the prefill
    assert m.can_allocate(Sequence(range(24), 4)) is AllocStatus.NEVER    # 6 blocks: the null block is reserved
    seq = allocated(m, range(20))
    for t in range(20, 60):                  # decoding then keeps only the window's blocks
        seq.append_token(t)
        assert m.can_append_slots(seq)
        m.append_slots(seq)
        assert sum(b != 0 for b in seq.block_table) <= 2
    assert m.num_free_blocks == 5 - sum(b != 0 for b in seq.block_table)


def test_released_blocks_make_room_for_the_same_step():
    m = BlockManager(4, block_size=2, sliding_window=2)      # 3 usable blocks
    seq = allocated(m, range(6))                             # all three in use
    for t in (6, 7):
        seq.append_token(t)
    assert m.can_append_slots(seq)                           # the step releases blocks 0 and 1 first
    m.append_slots(seq)
    assert sum(b != 0 for b in seq.block_table) == 2
    m.check_invariants()
