"""KV cache groups: one full-attention and one sliding-window group sharing one pool (HybridBlockManager)."""

import pytest

from kvlab import AllocStatus, BlockManager, InvalidArgumentError, OutOfBlocksError, PrefixCacheStats, Sequence
from kvlab.blocks.sequence import MAX_KEY_DEPTH
from kvlab.blocks.group_manager import GroupManager
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.prefix_cache import prompt_blocks
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec

BS = 4
GROUPS = [FullAttentionSpec(), SlidingWindowSpec(4)]


def make(num_blocks=32, **kw):
    return HybridBlockManager(num_blocks, BS, groups=GROUPS, **kw)


def test_each_group_has_its_own_table_and_slots_from_one_pool():
    m = make()
    seq = Sequence(range(10), BS)
    m.allocate(seq)
    full, window = m.block_tables(seq)
    assert len(full) == len(window) == 3 and not set(full) & set(window)
    assert m.num_free_blocks == 31 - 6  # block 0 is the window's null block
    slots = m.slot_mappings(seq, 0, 10)
    assert slots[0] == [full[p // BS] * BS + p % BS for p in range(10)]
    assert slots[1][:4] == [-1] * 4 or slots[1][0] == window[0] * BS  # window 4 from position 9: blocks 1, 2
    m.check_invariants()


def test_window_group_releases_blocks_that_leave_the_window_still_cached():
    m = make()
    seq = Sequence(range(8), BS)
    m.allocate(seq)
    before = m.block_tables(seq)[1]
    for t in range(8, 16):
        seq.append_token(t)
        m.append_slots(seq)
    full, window = m.block_tables(seq)
    assert all(b != 0 for b in full) and window[:2] == [0, 0]
    assert m.ref_count(before[0]) == 0 and m.is_cached(before[0])  # freed, evictable, still hittable
    assert m.slot_mappings(seq, 0, 4)[1] == [-1] * 4
    m.check_invariants()


def test_hit_is_cut_to_what_the_window_group_can_serve():
    m = make(num_blocks=13)  # 12 usable: tight, so new blocks soon reuse freed ones
    a = Sequence(range(12), BS)
    m.allocate(a)
    for t in range(12, 20):  # the window group releases a's first blocks: freed first, so evicted first
        a.append_token(t)
        m.append_slots(a)
    m.free(a)
    m.allocate(Sequence([99] * 8, BS))  # evicts the window group's released blocks (freed first)
    probe = Sequence(range(13), BS)
    hashes, contents = prompt_blocks(probe, BS, None)
    full_hit, window_hit = (len(group.find_hits(hashes, contents, 12)[0]) * BS for group in m._groups)
    assert full_hit == 12 and window_hit < full_hit
    assert m.get_num_cached_tokens(probe) == window_hit
    m.allocate(probe)
    assert probe.num_cached_tokens == window_hit
    m.check_invariants()


def test_same_tokens_in_two_groups_are_different_blocks_and_a_full_hit_needs_both():
    m = make()
    a, b = Sequence(range(9), BS), Sequence(range(9), BS)
    m.allocate(a)
    m.allocate(b)
    assert b.num_cached_tokens == 8
    assert m.block_tables(a)[0][:2] == m.block_tables(b)[0][:2]
    assert m.block_tables(a)[1][1] == m.block_tables(b)[1][1]
    m.check_invariants()


def test_fork_cow_and_swap_per_group():
    m = make(num_cpu_blocks=16)
    parent, child = Sequence(range(6), BS), Sequence([])
    m.allocate(parent)
    m.fork(parent, child)
    assert m.block_tables(child) == m.block_tables(parent)
    child.append_token(7)
    last = [table[-1] for table in m.block_tables(child)]
    pairs = m.append_slots(child)  # one list, group after group: each group copies its shared last block
    assert [src for src, _ in pairs] == last and [dst for _, dst in pairs] == [t[-1] for t in m.block_tables(child)]
    assert m.can_swap_out(child) is AllocStatus.OK
    out = m.swap_out(child)
    assert len(out) == sum(map(len, m.block_tables(parent)))  # the child holds as many blocks as its parent
    m.check_invariants()
    assert m.swap_in(child) and m.block_tables(child)[0][-1] != 0
    m.check_invariants()
    m.free(child)
    m.free(parent)
    m.check_invariants()
    assert m.num_free_blocks == 31


def test_admission_counts_every_group():
    m = make(num_blocks=5)  # 4 usable: 2 blocks per group fit, 3 do not
    assert m.can_allocate(Sequence(range(8), BS)) is AllocStatus.OK
    seq = Sequence(range(12), BS)
    assert m.can_allocate(seq) is AllocStatus.NEVER
    with pytest.raises(OutOfBlocksError):
        m.allocate(seq)
    m.check_invariants()
    assert m.num_free_blocks == 4


@pytest.mark.parametrize("groups", [[], "full", [FullAttentionSpec(), 3], [None], 5])
def test_bad_group_specs(groups):
    with pytest.raises(InvalidArgumentError, match="FullAttentionSpec"):
        HybridBlockManager(8, BS, groups=groups)


def test_bad_window():
    with pytest.raises(InvalidArgumentError, match="sliding window"):
        SlidingWindowSpec(0)


@pytest.mark.parametrize("num_blocks, fits", [(9, False), (11, True)])
def test_can_allocate_counts_the_out_of_window_hits_allocate_pins(num_blocks, fits):
    """allocate pins a window group's out-of-window hits while the groups allocate; with 8 free blocks and
    needing 10 (2 new, 8 hits) can_allocate said OK and allocate raised (found by the hybrid state machine)."""
    m = HybridBlockManager(num_blocks, 2, groups=[FullAttentionSpec(), SlidingWindowSpec(2)])
    earlier = Sequence(range(8), 2)
    m.allocate(earlier)
    m.free(earlier)  # its 8 blocks (4 per group) are free and cached
    probe = Sequence(range(9), 2)
    assert m.get_num_cached_tokens(probe) == 8
    assert (m.can_allocate(probe) is AllocStatus.OK) == fits
    if fits:
        m.allocate(probe)
    else:
        with pytest.raises(OutOfBlocksError):
            m.allocate(probe)
    m.check_invariants()


def nested(key, depth: int):
    for _ in range(depth):
        key = (key,)
    return key


@pytest.mark.parametrize("manager", [BlockManager(40, BS), make(40)], ids=["BlockManager", "HybridBlockManager"])
def test_both_managers_take_the_deepest_keys_a_sequence_accepts(manager):
    """The hybrid manager used to wrap block 0's key in a tuple with the group, one level too deep."""
    deepest = nested("deep", MAX_KEY_DEPTH)
    with pytest.raises(InvalidArgumentError, match="nested too deep"):
        Sequence(range(9), BS, extra_keys={0: nested("deep", MAX_KEY_DEPTH + 1)})
    first, again = (Sequence(range(9), BS, extra_keys={0: deepest}, cache_salt="tenant") for _ in range(2))
    other = Sequence(range(9), BS, extra_keys={0: nested("other", MAX_KEY_DEPTH)}, cache_salt="tenant")
    for seq in (first, again, other):
        manager.allocate(seq)
    assert (again.num_cached_tokens, other.num_cached_tokens) == (8, 0)
    manager.check_invariants()


def test_keyed_blocks_of_two_groups_stay_apart():
    m = make()
    a, b = (Sequence(range(9), BS, extra_keys={0: "image", 1: ("image", 2)}, cache_salt="t") for _ in range(2))
    m.allocate(a)
    m.allocate(b)
    full, window = m.block_tables(a)
    assert b.num_cached_tokens == 8 and m.block_tables(b)[0][:2] == full[:2]
    assert not set(full) & set(window)
    m.check_invariants()


@pytest.mark.parametrize("manager, usable", [
    (BlockManager(9, BS), 9),
    (BlockManager(9, BS, sliding_window=6, watermark=0.12), 7),  # less the null block and the 1-block watermark
    (make(9), 8),
], ids=["full", "window", "hybrid"])
@pytest.mark.parametrize("num_new_tokens", [None, 3])
def test_blocks_for_prompt_says_when_can_allocate_says_never(manager, usable, num_new_tokens):
    """The engine refuses a prompt up front with these numbers: they must be can_allocate's in an idle pool."""
    assert manager.usable_blocks == usable
    for n in range(3, 60):
        seq = Sequence(range(100, 100 + n), BS)
        never = manager.can_allocate(seq, num_new_tokens=num_new_tokens) is AllocStatus.NEVER
        assert never == (manager.blocks_for_prompt(n, num_new_tokens) > usable), n



def test_reset_prefix_cache_resets_every_groups_stats():
    """As BlockManager.reset_prefix_cache does (the groups' stats used to keep counting through a reset)."""
    m = make()
    for _ in range(2):
        seq = Sequence(range(9), BS)
        m.allocate(seq)
        m.free(seq)
    assert m.stats.hit_blocks == 2
    assert m.reset_prefix_cache()
    assert m.stats == PrefixCacheStats() and m.make_prefix_cache_stats() == PrefixCacheStats()


def test_a_group_offers_its_two_halves_and_queries_not_the_single_group_managers_calls():
    """The coordinator drives each group through its plan / bookkeeping halves; a group used to be a whole
    BlockManager, so allocating, freeing or vLLM V0's calls on one group (which would skip the other groups
    and the policy transaction across them) were one attribute away."""
    m = make(num_cpu_blocks=8)
    seq = Sequence(range(10), BS)
    m.allocate(seq)
    for group in m._groups:
        assert not isinstance(group, BlockManager)
        for call in ("allocate", "can_allocate", "append_slots", "free", "swap_out", "swap_in", "accept_drafts",
                     "mark_blocks_as_computed", "get_common_computed_block_ids", "access_all_blocks_in_seq",
                     "get_cross_block_table", "free_cross", "take_tier_moves"):
            assert not hasattr(group, call), call
    assert [list(group.records[seq.seq_id].table) for group in m._groups] == m.block_tables(seq)


def test_the_managers_are_flat_classes_over_one_group_manager_per_group():
    """BlockManager used to be nine classes deep (a coordinator, a group core and vLLM V0's interface mixed in),
    its bases reading fields other bases created, and each group of a hybrid sequence a shadow Sequence.
    Now the manager composes one GroupManager per group, which keeps its records in a dict by sequence id;
    BlockManager only writes the progress over it, and HybridBlockManager only takes groups= first."""
    assert len(BlockManager.__mro__) <= 3 and len(HybridBlockManager.__mro__) <= 4
    m = make()
    seq = Sequence(range(9), BS)
    m.allocate(seq)
    for group in m._groups:
        assert type(group) is GroupManager and group.records[seq.seq_id].seq is seq
        for name in ("allocate", "free", "block_tables", "mark_blocks_as_computed", "free_cross"):
            assert not hasattr(group, name), name


COORDINATED = ("can_allocate", "allocate", "can_append_slots", "append_slots", "accept_drafts", "free", "fork",
               "can_swap_out", "swap_out", "can_swap_in", "swap_in", "reset_prefix_cache", "check_invariants")


@pytest.mark.parametrize("call", COORDINATED)
def test_both_managers_run_one_implementation_of_each_lifecycle_call(call):
    """BlockManager is the coordinator's one-group case (kvlab.blocks.manager): a lifecycle call is the same
    code for one group and for several, not a single-group version and a hybrid copy that can drift apart."""
    assert getattr(BlockManager, call) is getattr(HybridBlockManager, call)


def test_a_hybrid_manager_refuses_an_encoder_sequence_clearly_and_changes_nothing():
    """Cross-attention tables are a one-group feature; a hybrid allocate(seq, encoder_seq) says so (it used to
    be a TypeError about the signature) and leaves the manager as it was."""
    m, seq, encoder = make(), Sequence(range(10), BS), Sequence(range(6), BS)
    for call in (m.allocate, m.can_allocate):
        with pytest.raises(InvalidArgumentError, match="encoder_seq"):
            call(seq, encoder_seq=encoder) if call == m.allocate else call(seq, 0, encoder)
    assert m.num_free_blocks == 31 and seq.block_table == ()
    m.check_invariants()
