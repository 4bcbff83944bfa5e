"""Speculative decoding in the block manager (kvlab.blocks.group_manager): ``append_slots(seq, num_draft_tokens=k)``
gives k proposed tokens slots after the last token, ``accept_drafts(seq, a)`` keeps the first a of them (their
tokens appended first) and rolls the progress counter back past the rest. A block holding an unverified token
is never sealed, hashed, published or hit."""

import pytest

from kvlab import (AllocStatus, BlockManager, InvalidArgumentError, InvariantViolation, OutOfBlocksError, Sequence,
                   SequenceStateError)
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.vllm_v0 import BlockSpaceManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.events import BlockRemoved, BlockStored

from helpers import snapshot

BS = 4


def single(num_blocks=16, **kw):
    return BlockManager(num_blocks, BS, **kw)


def hybrid(num_blocks=32, **kw):
    return HybridBlockManager(num_blocks, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(4)], **kw)


MANAGERS = pytest.mark.parametrize("make", [single, hybrid], ids=["single", "hybrid"])


def decoding(m, n=6):
    """A sequence of n prompt tokens plus one sampled token, which has no slot yet."""
    seq = Sequence(range(n), BS)
    m.allocate(seq)
    seq.append_token(100)
    return seq


def proposed(m, k, n=6):
    """``decoding``, then a step scheduling its sampled token and k drafts: positions n .. n + k."""
    seq = decoding(m, n)
    m.append_slots(seq, num_draft_tokens=k)
    return seq


def verify(m, seq, drafts, accepted, bonus=None, bonus_first=False):
    """The engine's side of verification: append the accepted drafts, then ``accept_drafts``, then the bonus
    (or the bonus first)."""
    for t in drafts[:accepted] + ([bonus] if bonus_first else []):
        seq.append_token(t)
    m.accept_drafts(seq, accepted)
    if bonus is not None and not bonus_first:
        seq.append_token(bonus)


@MANAGERS
def test_drafts_get_slots_after_the_last_token_and_advance_the_counter(make):
    m = make()
    seq = proposed(m, 3)                   # tokens 0..6, drafts at positions 7, 8, 9
    assert (seq.num_computed_tokens, seq.num_draft_tokens, seq.num_tokens) == (10, 3, 7)
    assert m.num_scheduled_tokens(seq) == 10 and len(seq.block_table) == 3
    assert all(slot >= 0 for slot in m.slot_mappings(seq, 6, 10)[0])
    m.check_invariants()


@MANAGERS
def test_a_block_holding_a_draft_is_never_sealed_published_or_hit(make):
    m = make(kv_events=True)
    with m.kv_events.subscribe() as events:
        seq = proposed(m, 5, n=4)          # block 1 = token 100 + drafts; block 2 = drafts
        stored = [e for e in events if type(e) is BlockStored]
        assert sum(len(e.block_hashes) for e in stored) == len(m.block_tables(seq))  # block 0, in each group
        table = m.block_tables(seq)[0]
        assert m.is_cached(table[0]) and not m.is_cached(table[1]) and not m.is_cached(table[2])
        # A prompt with those very tokens (the drafts were right) hits block 0 only: nothing verified them yet.
        other = Sequence([0, 1, 2, 3, 100, 7, 7, 7, 9], BS)
        assert m.get_num_cached_tokens(other) == 4
        m.check_invariants()


@MANAGERS
def test_accepted_drafts_keep_their_kv_and_their_blocks_are_sealed_at_once(make):
    m = make(kv_events=True)
    seq = proposed(m, 5, n=4)
    tables, free = m.block_tables(seq), m.num_free_blocks
    with m.kv_events.subscribe() as events:
        verify(m, seq, [7, 7, 7, 8, 8], 3, bonus=9)   # positions 5..7 accepted: block 1 is complete and verified
        [stored] = [e for e in events if type(e) is BlockStored][:1]
    assert seq.num_computed_tokens == 8 == seq.num_tokens - 1 and seq.num_draft_tokens == 0
    assert m.block_tables(seq) == tables and m.num_free_blocks == free   # no block taken: the K/V is reused
    assert stored.token_ids == [100, 7, 7, 7] and m.is_cached(tables[0][1]) and not m.is_cached(tables[0][2])
    assert m.get_num_cached_tokens(Sequence([0, 1, 2, 3, 100, 7, 7, 7, 9], BS)) == 8
    m.check_invariants()


@MANAGERS
def test_rejected_positions_roll_back_and_the_next_step_overwrites_their_slots(make):
    m = make()
    seq = proposed(m, 3)
    draft_slots, sizes = m.slot_mappings(seq, 7, 10), [len(table) for table in m.block_tables(seq)]
    verify(m, seq, [1, 2, 3], 0, bonus=50)            # all rejected; the bonus token sits at position 7
    assert (seq.num_computed_tokens, seq.num_tokens, m.num_scheduled_tokens(seq)) == (7, 8, 7)
    m.check_invariants()
    m.append_slots(seq, num_draft_tokens=2)           # position 7 and two new drafts: the same three slots
    assert m.slot_mappings(seq, 7, 10) == draft_slots and [len(table) for table in m.block_tables(seq)] == sizes
    m.check_invariants()


@MANAGERS
@pytest.mark.parametrize("bonus_first", [False, True])
@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_the_bonus_token_is_never_counted_as_computed(make, bonus_first, accepted):
    """Its slot holds a rejected draft's K/V (or none): appended before or after ``accept_drafts``, it waits for
    the next step."""
    m = make()
    seq = proposed(m, 3)
    verify(m, seq, [1, 2, 3], accepted, bonus=9, bonus_first=bonus_first)
    assert seq.num_computed_tokens == 7 + accepted == seq.num_tokens - 1
    m.check_invariants()


@MANAGERS
def test_a_sequence_with_drafts_in_flight_gets_no_other_step(make):
    m = make()
    seq = proposed(m, 2)
    before = snapshot(m), m.block_tables(seq)
    for call in (m.append_slots, m.can_append_slots):
        with pytest.raises(SequenceStateError, match="accept_drafts"):
            call(seq)
    assert (snapshot(m), m.block_tables(seq)) == before
    assert (seq.num_computed_tokens, seq.num_draft_tokens) == (9, 2)


@MANAGERS
@pytest.mark.parametrize("setup, call, error, match", [
    (lambda m: decoding(m), lambda m, s: m.accept_drafts(s, 0), SequenceStateError, "no draft tokens"),
    (lambda m: proposed(m, 2), lambda m, s: m.accept_drafts(s, 3), InvalidArgumentError, "num_accepted"),
    (lambda m: proposed(m, 2), lambda m, s: m.accept_drafts(s, -1), InvalidArgumentError, "num_accepted"),
    (lambda m: proposed(m, 2), lambda m, s: m.accept_drafts(s, 1), InvalidArgumentError, "append the accepted"),
    (lambda m: decoding(m), lambda m, s: m.append_slots(s, num_draft_tokens=-1), InvalidArgumentError,
     "num_draft_tokens"),
    (lambda m: Sequence(range(9), BS), lambda m, s: (m.allocate(s, num_new_tokens=3),
                                                     m.append_slots(s, num_new_tokens=2, num_draft_tokens=2)),
     InvalidArgumentError, "draft tokens follow the last token"),
])
def test_bad_draft_calls_change_nothing(make, setup, call, error, match):
    m = make()
    seq = setup(m)
    state = lambda: (snapshot(m), seq.num_computed_tokens,  # noqa: E731
                     seq.num_draft_tokens, seq.block_table)
    if seq.block_table:
        before = state()
        with pytest.raises(error, match=match):
            call(m, seq)
        assert state() == before
    else:  # allocated inside the call: only the failing append_slots must leave its chunk as it was
        with pytest.raises(error, match=match):
            call(m, seq)
        assert (seq.num_computed_tokens, seq.num_draft_tokens, len(seq.block_table)) == (3, 0, 1)


@MANAGERS
def test_room_for_drafts_is_counted(make):
    m = make(num_blocks=8 if make is single else 11)   # hybrid: both groups' blocks come out of one pool
    seq = decoding(m)                                   # 7 tokens: 2 blocks per group
    free = m.num_free_blocks
    groups = len(m.block_tables(seq))
    fits = (free // groups) * BS + 8 - seq.num_tokens     # the most drafts the free blocks hold
    assert m.can_append_slots(seq, num_draft_tokens=fits)
    assert not m.can_append_slots(seq, num_draft_tokens=fits + 1)
    with pytest.raises(OutOfBlocksError):
        m.append_slots(seq, num_draft_tokens=fits + 1)
    m.append_slots(seq, num_draft_tokens=fits)
    m.check_invariants()


@MANAGERS
def test_a_rejected_draft_never_releases_a_block_the_next_step_sees(make):
    """Window 4: the step after a rejection starts at the verified position, so it still sees the block a step
    starting after the drafts would already have released."""
    m = make() if make is hybrid else single(sliding_window=4)
    seq = proposed(m, 6)                             # verified 0..6, drafts 7..12
    verify(m, seq, [1] * 6, 0, bonus=5)              # all rejected: the next step's first query is 7
    m.append_slots(seq)
    window = m.slot_mappings(seq, 4, 8)[-1]          # positions 4..7: the window of a query at 7
    assert all(slot >= 0 for slot in window)         # counting the drafts (query at 13) would release block 1
    m.check_invariants()


@MANAGERS
def test_recompute_preemption_with_drafts_keeps_only_verified_blocks_warm(make):
    m = make()
    seq = proposed(m, 5, n=4)                        # block 1 holds token 100 and drafts
    m.free(seq, preempted=True)
    assert (seq.num_computed_tokens, seq.num_draft_tokens) == (0, 0)
    assert m.get_num_cached_tokens(Sequence([0, 1, 2, 3, 100, 7, 7, 7, 9], BS)) == 4
    m.allocate(seq)                                  # recomputed: prompt plus the sampled token, no drafts
    assert (seq.num_computed_tokens, seq.num_cached_tokens) == (5, 4)
    m.check_invariants()


@MANAGERS
def test_drafts_in_flight_swap_out_and_in_then_are_verified(make):
    m = make(num_cpu_blocks=16)
    seq = proposed(m, 3)
    m.swap_out(seq)
    with pytest.raises(SequenceStateError, match="swapped out"):
        m.accept_drafts(seq, 0)
    m.swap_in(seq)
    verify(m, seq, [7, 8, 9], 3, bonus=1)
    assert seq.num_computed_tokens == 10 and seq.num_draft_tokens == 0
    m.check_invariants()


@MANAGERS
def test_a_chunked_prompt_ends_with_drafts(make):
    m = make()
    seq = Sequence(range(9), BS)
    m.allocate(seq, num_new_tokens=5)
    m.append_slots(seq, num_draft_tokens=2)          # the last 4 prompt tokens and two drafts
    assert (seq.num_computed_tokens, seq.num_draft_tokens, seq.is_prefilling) == (11, 2, False)
    verify(m, seq, [3, 3], 1)
    assert seq.num_computed_tokens == 10 == seq.num_tokens
    m.check_invariants()


@MANAGERS
def test_fork_with_drafts_in_flight_and_siblings_that_disagree(make):
    """Both share the drafts' blocks; the parent accepts them all and seals block 1, the child rejects them: its
    next step copies the sealed block (the parent still holds it) instead of writing it in place."""
    m = make()
    parent = proposed(m, 5, n=4)                     # block 1: 100 + drafts 5..7; block 2: drafts 8, 9
    child = Sequence([])
    m.fork(parent, child)
    assert (child.num_computed_tokens, child.num_draft_tokens) == (10, 5)
    verify(m, parent, [7, 7, 7, 8, 8], 5, bonus=1)
    sealed = m.block_tables(parent)[0][1]
    assert m.is_cached(sealed) and m.block_tables(child)[0][1] == sealed
    m.check_invariants()
    verify(m, child, [7, 7, 7, 8, 8], 0, bonus=2)    # the child's position 5 holds 2, not the draft 7
    pairs = m.append_slots(child)
    assert sealed in [src for src, _ in pairs]
    assert m.block_tables(child)[0][1] != sealed and m.is_cached(sealed)
    m.check_invariants()


@MANAGERS
def test_a_sealed_block_held_alone_leaves_the_cache_before_it_is_written(make):
    """As above, but the parent is freed first: the child holds the block the parent sealed alone, and must not
    write it while it is hittable."""
    m = make(kv_events=True)
    parent = proposed(m, 5, n=4)
    child = Sequence([])
    m.fork(parent, child)
    verify(m, parent, [7, 7, 7, 8, 8], 5)
    sealed = m.block_tables(parent)[0][1]
    m.free(parent)
    verify(m, child, [7, 7, 7, 8, 8], 0, bonus=2)
    m.check_invariants()
    with m.kv_events.subscribe() as events:
        assert m.append_slots(child) in ([], [[]] * len(m.block_tables(child)))  # written in place, no copy
        assert any(type(e) is BlockRemoved for e in events)
    assert m.block_tables(child)[0][1] == sealed and not m.is_cached(sealed)
    assert m.get_num_cached_tokens(Sequence([0, 1, 2, 3, 100, 7, 7, 7, 9], BS)) == 4
    m.check_invariants()


@MANAGERS
def test_fork_siblings_with_drafts_swapped_out_and_in_keep_the_record_of_shared_blocks(make):
    """Both siblings go to the CPU sharing the drafts' blocks and come back sharing them again under new ids: the
    child seals one by accepting its drafts, which the parent, still holding drafts there, must know to be a
    sibling's (its next step copies it), so the invariant checker follows the ids through the swaps."""
    m = make(num_cpu_blocks=16)
    parent = proposed(m, 5, n=4)
    child = Sequence([])
    m.fork(parent, child)
    m.swap_out(child)
    m.swap_out(parent)
    m.swap_in(child)
    verify(m, child, [7, 7, 7, 8, 8], 5)
    m.swap_in(parent)
    sealed = m.block_tables(child)[0][1]
    assert m.is_cached(sealed) and m.block_tables(parent)[0][1] == sealed
    m.check_invariants()
    verify(m, parent, [7, 7, 7, 8, 8], 0, bonus=2)
    assert sealed in [src for src, _ in m.append_slots(parent)]
    m.check_invariants()


@MANAGERS
def test_siblings_accepting_the_same_drafts_share_the_sealed_block(make):
    m = make(kv_events=True)
    parent = proposed(m, 5, n=4)
    child = Sequence([])
    m.fork(parent, child)
    verify(m, parent, [7, 7, 7, 8, 8], 4)
    with m.kv_events.subscribe() as events:
        verify(m, child, [7, 7, 7, 8, 8], 4)
        assert [e for e in events if type(e) is BlockStored] == []   # sealed once, by the parent
    assert m.block_tables(child) == m.block_tables(parent)
    m.check_invariants()
    parent.append_token(3)
    child.append_token(4)
    m.append_slots(parent)
    m.append_slots(child)
    m.check_invariants()


@pytest.mark.parametrize("corrupt, match", [
    (lambda s: setattr(s, "num_draft_tokens", 0), "blocks for"),          # drafts counted as verified tokens
    (lambda s: setattr(s, "num_draft_tokens", 11), "blocks for"),
    # drafts taken as accepted without accept_drafts: block 1 would be verified, and it is not sealed
    (lambda s: ([s.append_token(7) for _ in range(3)], setattr(s, "num_draft_tokens", 1)), "sealed blocks"),
])
def test_check_invariants_audits_the_drafts(corrupt, match):
    m = single()
    seq = proposed(m, 4, n=4)                        # 5 tokens, 4 drafts: 9 positions
    m.check_invariants()
    corrupt(seq)
    with pytest.raises(InvariantViolation, match=match):
        m.check_invariants()


def test_check_invariants_catches_a_hittable_block_holding_drafts():
    m = single()
    seq = proposed(m, 5, n=4)
    block = seq.block_table[1]
    m._pool.seal([block], [12345], [b"drafts"], m._pool.index.content_id(seq.block_table[0]))
    with pytest.raises(InvariantViolation, match="still to be scheduled or verified is hittable"):
        m.check_invariants()


def test_vllm_v0_marks_only_verified_positions_computed():
    m = BlockSpaceManager(16, block_size=4)
    seq = proposed(m, 5, n=4)                        # block 1 holds token 100 and drafts
    m.mark_blocks_as_computed(seq)
    assert m.get_common_computed_block_ids([seq]) == [seq.block_table[0]]
    m.check_invariants()


def test_drafts_of_a_running_sequence_may_use_the_watermark_but_admissions_may_not():
    m = single(num_blocks=10, watermark=0.2)         # 2 blocks kept free for running sequences
    seq = decoding(m)                                 # 2 blocks
    m.allocate(Sequence(range(50, 72), BS))           # 6 blocks: the 2 free ones are the watermark
    assert m.can_allocate(Sequence(range(3), BS)) is AllocStatus.LATER
    assert m.can_append_slots(seq, num_draft_tokens=16 - seq.num_tokens)  # its blocks 2 and 3: the watermark's
    m.append_slots(seq, num_draft_tokens=16 - seq.num_tokens)
    assert m.num_free_blocks == 0
    m.check_invariants()
