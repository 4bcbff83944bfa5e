"""Chunked prompts (vLLM V1's ``allocate_slots(request, num_new_tokens)``): ``allocate(seq, num_new_tokens=k)``
admits a prompt with its prefix hits and a first chunk, ``append_slots(seq, num_new_tokens=k)`` schedules the
next ones. A block becomes hittable when the step that writes its last token is scheduled, never before."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import (AllocStatus, BlockManager, InvalidArgumentError, InvariantViolation, OutOfBlocksError, Sequence,
                   SequenceStatus, SequenceStateError)
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec

from helpers import allocated, snapshot

PROMPT = list(range(10))  # block size 4: blocks [0..3] [4..7] [8, 9]


def chunked(manager, tokens, first, *rest):
    """Admit ``tokens`` with a first chunk of ``first`` tokens after its hits, then schedule ``rest``."""
    seq = Sequence(tokens, manager.block_size)
    manager.allocate(seq, num_new_tokens=first)
    for k in rest:
        manager.append_slots(seq, num_new_tokens=k)
    return seq


def test_a_chunk_gets_slots_for_its_tokens_only():
    m = BlockManager(8, block_size=4)
    seq = chunked(m, PROMPT, 3)
    assert m.num_scheduled_tokens(seq) == 3 and len(seq.block_table) == 1 and m.num_free_blocks == 7
    assert m.slot_mapping(seq, 0, 3) == [seq.block_table[0] * 4 + p for p in range(3)]
    with pytest.raises(InvalidArgumentError, match="positions with slots"):
        m.slot_mapping(seq, 0, 4)
    m.append_slots(seq, num_new_tokens=2)   # the boundary falls inside block 1
    assert m.num_scheduled_tokens(seq) == 5 and len(seq.block_table) == 2
    m.append_slots(seq, num_new_tokens=1)   # a one-token chunk into the same block takes no block
    assert len(seq.block_table) == 2 and m.num_free_blocks == 6
    m.append_slots(seq)                     # None: the rest of the prompt
    assert m.num_scheduled_tokens(seq) == 10 and len(seq.block_table) == 3
    slots = m.slot_mapping(seq, 0, 10)
    assert slots == [seq.block_table[p // 4] * 4 + p % 4 for p in range(10)]
    m.check_invariants()


def test_a_block_is_hittable_only_once_its_last_token_is_scheduled():
    m = BlockManager(16, block_size=4)
    a = chunked(m, PROMPT, 6)              # block 0 complete, block 1 half scheduled
    assert m.is_cached(a.block_table[0]) and not m.is_cached(a.block_table[1])
    # Same step, same prefix (nano-vllm #208/#219): b must not hit block 1, whose tokens 6, 7 nobody wrote.
    b = chunked(m, PROMPT, 1)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    m.append_slots(a, num_new_tokens=2)    # the step that writes block 1's last token is scheduled...
    assert m.is_cached(a.block_table[1])
    c = allocated(m, PROMPT)               # ...so a request of that same step hits it (write before read)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]
    m.check_invariants()


def test_a_chunk_ending_on_a_block_boundary_seals_that_block():
    m = BlockManager(16, block_size=4)
    a = chunked(m, PROMPT, 4, 4)
    assert [m.is_cached(b) for b in a.block_table] == [True, True]
    assert allocated(m, PROMPT).num_cached_tokens == 8


def test_hits_are_found_once_at_admission():
    m = BlockManager(16, block_size=4)
    a = chunked(m, PROMPT, 6)
    b = chunked(m, PROMPT, 1)              # hits block 0 only
    m.append_slots(a)                      # a's block 1 becomes hittable; b's later chunks compute their own
    m.append_slots(b)
    assert b.num_cached_tokens == 4 and b.block_table[1] != a.block_table[1]
    assert m.block_hash(b.block_table[1]) == m.block_hash(a.block_table[1])
    assert not m.is_cached(b.block_table[1])  # a duplicate: the cache keeps a's block
    m.check_invariants()


@given(cuts=st.lists(st.integers(1, 5), max_size=12), n=st.integers(1, 23))
def test_any_chunking_seals_what_a_whole_prompt_allocation_seals(cuts, n):
    whole, parts = BlockManager(16, block_size=4), BlockManager(16, block_size=4)
    tokens = list(range(100, 100 + n))
    one = allocated(whole, tokens)
    seq = Sequence(tokens, 4)
    parts.allocate(seq, num_new_tokens=min(cuts[0], n) if cuts else n)
    for k in cuts[1:]:
        left = n - parts.num_scheduled_tokens(seq)
        if left:
            parts.append_slots(seq, num_new_tokens=min(k, left))
        parts.check_invariants()
    parts.append_slots(seq)
    assert [parts.block_hash(b) for b in seq.block_table] == [whole.block_hash(b) for b in one.block_table]
    assert parts.num_cached_blocks == whole.num_cached_blocks == n // 4
    parts.check_invariants()


def test_prompt_blocks_are_hashed_once_at_admission():
    calls = []

    def counting_hash(parent, ids):
        calls.append(ids)
        return hash((parent, ids))

    m = BlockManager(16, block_size=4, hash_fn=counting_hash)
    chunked(m, list(range(12)), 1, 1, 5, 5)
    assert len(calls) == 3 and m.num_cached_blocks == 3  # three full blocks, sealed over four steps


def test_admission_of_a_first_chunk_needs_only_its_blocks():
    m = BlockManager(8, block_size=4)
    allocated(m, range(100, 120))          # 5 blocks in use, 3 free
    seq = Sequence(range(24), 4)           # 6 blocks in all
    assert m.can_allocate(seq) is AllocStatus.LATER
    assert m.can_allocate(seq, num_new_tokens=12) is AllocStatus.OK
    assert m.can_allocate(seq, num_new_tokens=13) is AllocStatus.LATER
    m.allocate(seq, num_new_tokens=12)
    assert m.num_free_blocks == 0
    assert not m.can_append_slots(seq, num_new_tokens=1)


def test_the_watermark_applies_to_admission_of_a_chunk():
    m = BlockManager(8, block_size=4, watermark=0.25)  # keeps 2 blocks free at admission
    allocated(m, range(100, 120))
    seq = Sequence(range(24), 4)
    assert m.can_allocate(seq, num_new_tokens=8) is AllocStatus.LATER  # 3 free - 2 < 2
    assert m.can_allocate(seq, num_new_tokens=4) is AllocStatus.OK
    m.allocate(seq, num_new_tokens=4)
    # Once admitted, its chunks are a running sequence's steps (like decode): the watermark is not theirs.
    assert m.can_append_slots(seq, num_new_tokens=8)


def test_a_prompt_that_can_never_finish_is_refused_however_small_its_first_chunk():
    m = BlockManager(4, block_size=4)
    seq = Sequence(range(17), 4)           # 5 blocks: never fits
    assert m.can_allocate(seq, num_new_tokens=1) is AllocStatus.NEVER
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="to finish its prompt"):
        m.allocate(seq, num_new_tokens=1)
    assert snapshot(m) == before and seq.status is SequenceStatus.WAITING
    assert m.can_allocate(Sequence(range(16), 4), num_new_tokens=1) is AllocStatus.OK


def test_with_a_sliding_window_chunks_finish_a_prompt_longer_than_the_pool():
    m = BlockManager(4, block_size=4, sliding_window=4)  # 3 usable blocks
    seq = Sequence(range(40), 4)                        # 10 blocks
    assert m.can_allocate(seq) is AllocStatus.NEVER     # one step's first query sees the whole prompt
    assert m.can_allocate(seq, num_new_tokens=4) is AllocStatus.OK
    m.allocate(seq, num_new_tokens=4)
    while m.num_scheduled_tokens(seq) < 40:
        m.append_slots(seq, num_new_tokens=4)           # each step releases what its first query cannot see
        assert len(seq.block_table) - m.num_released_blocks(seq) <= 3
        m.check_invariants()
    assert -1 not in m.slot_mapping(seq, 33, 40)


def test_lookahead_slots_serve_the_next_chunk():
    m = BlockManager(8, block_size=4)
    seq = chunked(m, PROMPT, 2)
    m.append_slots(seq, 3, num_new_tokens=1)            # 3 scheduled + 3 lookahead slots: 2 blocks
    assert len(seq.block_table) == 2 and m.num_scheduled_tokens(seq) == 3
    assert len(m.slot_mapping(seq, 0, 6)) == 6
    with pytest.raises(InvalidArgumentError, match="positions with slots"):
        m.slot_mapping(seq, 0, 7)
    free = m.num_free_blocks
    m.append_slots(seq, num_new_tokens=3)               # lands in the reserved slots: no new block
    assert m.num_free_blocks == free and m.num_scheduled_tokens(seq) == 6
    m.check_invariants()


def test_preempting_a_partly_prefilled_sequence_keeps_only_its_scheduled_blocks_warm():
    m = BlockManager(8, block_size=4)
    seq = chunked(m, PROMPT, 6)
    first, second = seq.block_table
    m.free(seq, preempted=True)
    assert seq.status is SequenceStatus.WAITING and seq.num_cached_tokens == 0 and m.num_free_blocks == 8
    assert m.is_cached(first) and not m.is_cached(second)
    m.allocate(seq, num_new_tokens=2)                   # recompute: the warm block is a hit
    assert seq.num_cached_tokens == 4 and seq.block_table[0] == first and m.num_scheduled_tokens(seq) == 6
    m.check_invariants()


def test_a_partly_prefilled_sequence_swaps_out_and_in_and_goes_on():
    m = BlockManager(8, block_size=4, num_cpu_blocks=4)
    seq = chunked(m, PROMPT, 5)
    m.swap_out(seq)
    with pytest.raises(SequenceStateError, match="swapped out"):
        m.append_slots(seq, num_new_tokens=1)
    assert m.num_scheduled_tokens(seq) == 5
    m.swap_in(seq)
    m.append_slots(seq, num_new_tokens=3)
    m.append_slots(seq)
    assert m.num_scheduled_tokens(seq) == 10 and len(seq.block_table) == 3
    assert len(set(m.slot_mapping(seq, 0, 10))) == 10
    m.check_invariants()


def test_a_fork_in_the_middle_of_a_prefill_copies_the_shared_block_it_writes():
    m = BlockManager(8, block_size=4)
    parent = chunked(m, PROMPT, 6)
    child = Sequence([])
    m.fork(parent, child)
    assert m.num_scheduled_tokens(child) == 6 and child.block_table == parent.block_table
    shared = parent.block_table[1]
    pairs = m.append_slots(parent, num_new_tokens=2)    # writes into block 1, which both hold
    assert pairs == [(shared, parent.block_table[1])] and child.block_table[1] == shared
    assert m.append_slots(child) == []                  # now only the child holds it: written in place
    assert m.num_scheduled_tokens(child) == 10
    m.check_invariants()


def test_a_fork_after_a_chunked_prefill_decodes_like_any_fork():
    m = BlockManager(8, block_size=4)
    parent = chunked(m, PROMPT, 3, 3, 4)
    child = Sequence([])
    m.fork(parent, child)
    child.append_token(7)
    last = parent.block_table[2]
    assert m.append_slots(child) == [(last, child.block_table[2])]  # the shared partial block is copied
    m.check_invariants()


@pytest.mark.parametrize("k, match", [
    (0, r"in \[1, 10\], got 0 \(sequence \d+ has 10 tokens without a slot"), (-1, r"in \[1, 10\]"),
    (11, r"in \[1, 10\], got 11"), (True, "must be an int"), (2.0, "must be an int"),
])
def test_a_bad_first_chunk_changes_nothing(k, match):
    m = BlockManager(8, block_size=4)
    seq = Sequence(PROMPT, 4)
    before = snapshot(m)
    for action in (lambda: m.can_allocate(seq, num_new_tokens=k), lambda: m.allocate(seq, num_new_tokens=k)):
        with pytest.raises(InvalidArgumentError, match=match):
            action()
    assert snapshot(m) == before and seq.status is SequenceStatus.WAITING and seq.block_table == ()


def test_a_first_chunk_counts_after_the_prefix_hits():
    m = BlockManager(8, block_size=4)
    allocated(m, PROMPT)
    seq = Sequence(PROMPT, 4)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match=r"in \[1, 2\], got 3 .* after its 8 cached"):
        m.allocate(seq, num_new_tokens=3)
    assert snapshot(m) == before
    m.allocate(seq, num_new_tokens=2)
    assert m.num_scheduled_tokens(seq) == 10


@pytest.mark.parametrize("k, error, match", [
    (0, InvalidArgumentError, r"in \[1, 4\]"), (5, InvalidArgumentError, r"in \[1, 4\], got 5"),
    ("2", InvalidArgumentError, "must be an int"),
])
def test_a_bad_chunk_changes_nothing(k, error, match):
    m = BlockManager(8, block_size=4)
    seq = chunked(m, PROMPT, 6)
    before = snapshot(m), seq.block_table
    for action in (lambda: m.can_append_slots(seq, num_new_tokens=k),
                   lambda: m.append_slots(seq, num_new_tokens=k)):
        with pytest.raises(error, match=match):
            action()
    assert (snapshot(m), seq.block_table) == before and m.num_scheduled_tokens(seq) == 6


def test_a_chunk_needs_a_sequence_with_tokens_left_on_the_gpu():
    m = BlockManager(8, block_size=4, num_cpu_blocks=4)
    with pytest.raises(SequenceStateError, match="not allocated"):
        m.append_slots(Sequence(PROMPT, 4), num_new_tokens=1)
    done = chunked(m, PROMPT, 10)
    with pytest.raises(InvalidArgumentError, match="has a slot already"):
        m.append_slots(done, num_new_tokens=1)
    m.swap_out(done)
    with pytest.raises(SequenceStateError, match="swapped out"):
        m.can_append_slots(done, num_new_tokens=1)
    m.swap_in(done)
    m.free(done)
    with pytest.raises(SequenceStateError, match="not allocated"):
        m.append_slots(done, num_new_tokens=1)


def test_a_chunk_that_does_not_fit_changes_nothing():
    m = BlockManager(3, block_size=4)
    seq = chunked(m, PROMPT, 4)
    allocated(m, range(100, 108))          # the last two blocks
    before = snapshot(m), seq.block_table
    with pytest.raises(OutOfBlocksError, match="check can_append_slots"):
        m.append_slots(seq, num_new_tokens=1)
    assert (snapshot(m), seq.block_table) == before and m.num_scheduled_tokens(seq) == 4


@pytest.mark.parametrize("corrupt, match", [
    (lambda a: setattr(a, "num_sealed", 1), "sealed blocks"),
    (lambda a: setattr(a, "num_slots", a.num_slots + 4), "blocks for"),
    (lambda a: setattr(a.seq, "num_computed_tokens", a.seq.num_tokens + 1), "blocks for"),
    (lambda a: setattr(a.seq, "num_computed_tokens", -1), "blocks for"),
    (lambda a: setattr(a.seq, "num_computed_tokens", 8.0), "blocks for"),
    (lambda a: setattr(a.seq, "num_computed_tokens", 4), "sealed blocks"),
    (lambda a: (setattr(a.seq, "num_computed_tokens", 4), setattr(a, "num_sealed", 1)),
     "still to be scheduled or verified is hittable"),
    (lambda a: setattr(a.seq, "prefill_end", a.seq.num_tokens + 1), "prefills up to"),
])
def test_check_invariants_audits_the_scheduled_state(corrupt, match):
    m = BlockManager(8, block_size=4)
    seq = chunked(m, PROMPT, 8)
    m.check_invariants()
    corrupt(seq.allocation)
    with pytest.raises(InvariantViolation, match=match):
        m.check_invariants()


@pytest.mark.parametrize("make", [
    lambda: BlockManager(16, block_size=4, num_cpu_blocks=16),
    lambda: HybridBlockManager(16, 4, groups=[FullAttentionSpec(), SlidingWindowSpec(4)], num_cpu_blocks=16),
], ids=["single", "hybrid"])
def test_the_progress_counter_lives_on_the_sequence(make):
    """``seq.num_computed_tokens`` (vLLM V1's name) is how far the sequence got: advanced when a step is scheduled,
    kept through swapping, copied by fork, 0 once freed; ``prefill_end`` says where its prefill ends."""
    m = make()
    seq = chunked(m, PROMPT, 3)
    assert (seq.num_computed_tokens, seq.prefill_end, seq.is_prefilling) == (3, 10, True)
    m.append_slots(seq, num_new_tokens=6)
    assert (seq.num_computed_tokens, seq.is_prefilling) == (9, True)  # one prompt token left: still a prefill
    m.append_slots(seq)
    assert (seq.num_computed_tokens, seq.is_prefilling) == (10, False) == (m.num_scheduled_tokens(seq), False)
    seq.append_token(7)
    assert seq.num_computed_tokens == 10 and not seq.is_prefilling  # the sampled token waits for a decode step
    m.append_slots(seq)
    m.swap_out(seq)
    m.swap_in(seq)
    child = Sequence([], 4)
    m.fork(seq, child)
    assert (child.num_computed_tokens, child.prefill_end) == (11, 10) == (m.num_scheduled_tokens(child), 10)
    m.check_invariants()
    m.free(seq, preempted=True)
    assert (seq.num_computed_tokens, seq.prefill_end, seq.is_prefilling) == (0, 0, False)
    m.allocate(seq, num_new_tokens=2)  # recomputed after 2 hits: its prompt and what it generated are prefilled
    assert (seq.num_computed_tokens, seq.prefill_end, seq.is_prefilling) == (10, 11, True)
    m.check_invariants()
