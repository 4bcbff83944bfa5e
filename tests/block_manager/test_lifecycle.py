"""Decode growth, copy-on-write forks, swapping, sliding window and status bookkeeping."""

import pytest
from helpers import allocated, grow, snapshot

from kvlab import BlockManager, OutOfBlocksError, Sequence, SequenceStatus
from kvlab.blocks.manager import AllocStatus


def test_decode_growth_adds_a_block_only_when_the_last_one_is_full():
    manager = BlockManager(8, block_size=4)
    seq = allocated(manager, [1, 2, 3, 4])
    assert len(seq.block_table) == 1
    assert grow(manager, seq, [5]) == [] and len(seq.block_table) == 2
    grow(manager, seq, [6, 7, 8])
    assert len(seq.block_table) == 2 and manager.is_cached(seq.block_table[1])
    assert manager.slot_mapping(seq, 0, 8) == [seq.block_table[p // 4] * 4 + p % 4 for p in range(8)]
    manager.check_invariants()


def test_lookahead_slots_reserve_blocks_for_speculative_tokens():
    manager = BlockManager(8, block_size=4)
    seq = allocated(manager, [1, 2, 3])
    seq.append_token(4)
    manager.append_slots(seq, num_lookahead_slots=5)   # positions up to 3 + 5 = 8 -> 3 blocks
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert manager.can_append_slots(seq, 28) and not manager.can_append_slots(seq, 29)  # 8 blocks = 32 slots


def test_fork_shares_every_block_and_allocates_nothing():
    manager = BlockManager(8, block_size=4)
    parent = allocated(manager, range(6))
    free_before = manager.num_free_blocks
    child = Sequence([])
    manager.fork(parent, child)
    assert child.token_ids == parent.token_ids and child.block_table == parent.block_table
    assert child.status is SequenceStatus.RUNNING and manager.num_free_blocks == free_before
    assert [manager.ref_count(b) for b in parent.block_table] == [2, 2]


def test_append_into_a_shared_partial_block_copies_it_once():
    manager = BlockManager(8, block_size=4)
    parent = allocated(manager, range(6))
    child = Sequence([])
    manager.fork(parent, child)
    shared_tail = parent.block_table[1]
    pairs = grow(manager, child, [100])
    assert pairs == [(shared_tail, child.block_table[1])] and child.block_table[1] != shared_tail
    assert parent.block_table[1] == shared_tail and parent.token_ids == list(range(6))
    assert child.block_table[0] == parent.block_table[0] and manager.ref_count(shared_tail) == 1
    assert grow(manager, parent, [200]) == []          # now the only owner: writes in place
    manager.check_invariants()


def test_full_shared_blocks_are_never_copied():
    manager = BlockManager(8, block_size=4)
    parent = allocated(manager, range(8))
    child = Sequence([])
    manager.fork(parent, child)
    assert grow(manager, child, [1]) == [] and grow(manager, parent, [2]) == []
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]


def test_fork_of_a_ten_thousand_block_sequence():
    manager = BlockManager(10_001, block_size=1)
    parent = allocated(manager, range(10_000))
    child = Sequence([], 1)
    manager.fork(parent, child)
    assert child.block_table == parent.block_table and manager.ref_count(parent.block_table[-1]) == 2
    manager.check_invariants()


def test_swap_out_and_in_round_trip():
    manager = BlockManager(8, block_size=4, num_cpu_blocks=8)
    seq = allocated(manager, range(10))
    gpu_blocks = list(seq.block_table)
    out = manager.swap_out(seq)
    assert [g for g, _ in out] == gpu_blocks and seq.status is SequenceStatus.SWAPPED
    assert manager.num_free_blocks == 8 and manager.num_free_cpu_blocks == 5
    back = manager.swap_in(seq)
    assert [c for c, _ in back] == [c for _, c in out] and list(seq.block_table) == [g for _, g in back]
    assert seq.status is SequenceStatus.RUNNING and manager.num_free_cpu_blocks == 8
    manager.check_invariants()


def test_forked_group_moves_shared_blocks_once_each_way():
    manager = BlockManager(16, block_size=4, num_cpu_blocks=16)
    parent = allocated(manager, range(10))
    children = [Sequence([]) for _ in range(3)]
    for child in children:
        manager.fork(parent, child)
        grow(manager, child, [child.seq_id])            # each diverges in its last block
    group = [parent, *children]
    out = [pair for seq in group for pair in manager.swap_out(seq)]
    moved = [g for g, _ in out]
    assert len(moved) == len(set(moved)) == 2 + 4      # 2 shared full blocks once, 4 distinct tails
    assert all(manager.is_swapped(seq) for seq in group) and manager.num_cpu_blocks == 16
    assert [manager.cpu_ref_count(c) for c in parent.block_table] == [4, 4, 1]
    manager.check_invariants()
    back = [pair for seq in group for pair in manager.swap_in(seq)]
    assert len(back) == 6 and len({c for c, _ in back}) == 6
    assert len({seq.block_table[0] for seq in group}) == 1  # still shared after coming back
    manager.check_invariants()


def test_append_while_a_sharer_is_swapped_out_invalidates_the_cpu_copy():
    manager = BlockManager(8, block_size=4, num_cpu_blocks=8)
    a = allocated(manager, range(6))
    b = Sequence([])
    manager.fork(a, b)
    manager.swap_out(a)                      # copies the shared partial block
    grow(manager, b, [99])                   # b is its only owner now: writes it in place
    out_b = manager.swap_out(b)
    assert len(out_b) == 1                   # the modified tail is copied again; the full head is not
    assert manager.swap_in(b) and manager.swap_in(a)
    assert a.block_table[1] != b.block_table[1]
    manager.check_invariants()


def test_cannot_swap_without_room():
    manager = BlockManager(8, block_size=4, num_cpu_blocks=1)
    seq = allocated(manager, range(10))
    assert manager.can_swap_out(seq) is AllocStatus.NEVER   # 3 blocks can never fit in a 1-block CPU pool
    before = snapshot(manager)
    with pytest.raises(OutOfBlocksError):
        manager.swap_out(seq)
    assert snapshot(manager) == before and seq.status is SequenceStatus.RUNNING
    manager = BlockManager(3, block_size=4, num_cpu_blocks=8)
    seq = allocated(manager, range(10))
    manager.swap_out(seq)
    allocated(manager, range(50, 55))
    assert manager.can_swap_in(seq) is AllocStatus.LATER


def test_free_while_swapped_releases_cpu_blocks():
    manager = BlockManager(8, block_size=4, num_cpu_blocks=4)
    seq = allocated(manager, range(10))
    manager.swap_out(seq)
    manager.free(seq)
    assert manager.num_free_cpu_blocks == 4 and seq.status is SequenceStatus.FINISHED
    manager.check_invariants()


def test_sliding_window_keeps_used_blocks_bounded():
    manager = BlockManager(10, block_size=4, sliding_window=8)
    seq = allocated(manager, range(30))
    for step in range(200):
        grow(manager, seq, [step])
        live = [b for b in seq.block_table if b != 0]
        assert len(live) <= 8 // 4 + 1
        manager.check_invariants()
    n = seq.num_tokens
    assert manager.num_released_blocks(seq) == (n - 8) // 4
    slots = manager.slot_mapping(seq, 0, n)
    assert all(s == -1 for s in slots[:(n - 8) // 4 * 4]) and all(s >= 4 for s in slots[n - 8:])
    manager.free(seq)
    assert manager.num_free_blocks == 9  # block 0 is the reserved null block


def test_cannot_swap_out_until_the_cpu_pool_has_room():
    manager = BlockManager(8, block_size=4, num_cpu_blocks=3)
    first, second = allocated(manager, range(10)), allocated(manager, range(20, 25))
    manager.swap_out(first)
    assert manager.can_swap_out(second) is AllocStatus.LATER
    manager.free(first)
    assert manager.can_swap_out(second) is AllocStatus.OK


def test_sliding_window_prefill_needs_the_whole_prompt_but_chunks_stay_bounded():
    manager = BlockManager(5, block_size=4, sliding_window=8)
    # One-shot prefill: its first query attends to key 0 and its last to the last 8 keys, all in one pass.
    assert manager.can_allocate(Sequence(range(1000), 4)) is AllocStatus.NEVER
    seq = allocated(manager, range(8))
    for chunk in range(1, 60):                       # chunked prefill, 8 tokens a step
        for t in range(8 * chunk, 8 * chunk + 8):
            seq.append_token(t)
        manager.append_slots(seq)
        assert sum(b != 0 for b in seq.block_table) <= 4   # the window's 8 keys + the chunk's 8 tokens
    manager.check_invariants()


def test_status_follows_the_managers_actions_not_the_callers():
    manager = BlockManager(8, block_size=4, num_cpu_blocks=4)
    seq = allocated(manager, range(5))
    assert seq.status is SequenceStatus.RUNNING
    seq.status = SequenceStatus.FINISHED    # a caller's status does not block anything
    grow(manager, seq, [9])
    manager.swap_out(seq)
    assert seq.status is SequenceStatus.SWAPPED
    manager.swap_in(seq)
    manager.free(seq, preempted=True)
    assert seq.status is SequenceStatus.WAITING and seq.num_cached_tokens == 0
    manager.allocate(seq)                   # a preempted sequence is recomputed from its tokens
    assert seq.num_cached_tokens == 4
    manager.free(seq)
    assert seq.status is SequenceStatus.FINISHED
