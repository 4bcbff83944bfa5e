"""Bad input gets a clear kvlab error and changes nothing."""

import pytest

from kvlab import (BlockManager, InvalidArgumentError, InvariantViolation, KvlabError, OutOfBlocksError,
                   Sequence, SequenceStateError)
from kvlab.blocks import KVCacheManager
from kvlab.blocks.sequence import encode_key

from helpers import allocated, snapshot


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=0), "num_blocks"), (dict(num_blocks=-5), "num_blocks"), (dict(num_blocks=2.5), "num_blocks"),
    (dict(num_blocks=8, block_size=0), "block_size"), (dict(num_blocks=8, num_cpu_blocks=-1), "num_cpu_blocks"),
    (dict(num_blocks=8, watermark=1.0), "watermark"), (dict(num_blocks=8, watermark=-0.1), "watermark"),
    (dict(num_blocks=8, sliding_window=0), "sliding_window"), (dict(num_blocks=1, sliding_window=4), "num_blocks"),
    (dict(num_blocks=8, hash_fn=3), "hash_fn"), (dict(num_blocks=8, eviction="mru"), "eviction"),
    (dict(num_blocks=10**30), r"num_blocks must be an int in \[1, 16777216\]"),
    (dict(num_blocks=8, num_cpu_blocks=10**30), r"num_cpu_blocks must be an int in \[0, 16777216\]"),
    (dict(num_blocks=8, block_size=10**30), "block_size"), (dict(num_blocks=8, watermark=float("nan")), "watermark"),
])
def test_bad_configuration(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BlockManager(**kwargs)


def test_a_copy_on_write_plan_must_be_callable():
    with pytest.raises(InvalidArgumentError, match=r"plan_append must be callable as plan_append\(block_table"):
        KVCacheManager(8, plan_append=3)


@pytest.fixture
def busy():
    """A manager with some history: a running sequence, a freed one (warm blocks), a fork."""
    manager = BlockManager(12, block_size=4, num_cpu_blocks=4)
    running = allocated(manager, range(10))
    manager.free(allocated(manager, range(50, 59)))
    child = Sequence([])
    manager.fork(running, child)
    return manager, running, child


def _expect_no_change(manager, error, action, match):
    before = snapshot(manager)
    with pytest.raises(error, match=match):
        action()
    assert snapshot(manager) == before
    manager.check_invariants()


def test_double_free(busy):
    manager, running, _ = busy
    manager.free(running)
    _expect_no_change(manager, SequenceStateError, lambda: manager.free(running), "not allocated")


def test_free_of_an_unknown_sequence(busy):
    manager = busy[0]
    _expect_no_change(manager, SequenceStateError, lambda: manager.free(Sequence([1], 4)), "not allocated")
    _expect_no_change(manager, InvalidArgumentError, lambda: manager.free([1, 2]), "kvlab.Sequence")


def test_append_to_an_unallocated_sequence(busy):
    manager = busy[0]
    seq = Sequence([1, 2], 4)
    seq.append_token(3)
    _expect_no_change(manager, SequenceStateError, lambda: manager.append_slots(seq), "not allocated")


def test_fork_of_an_unallocated_parent_or_into_an_allocated_child(busy):
    manager, running, child = busy
    _expect_no_change(manager, SequenceStateError, lambda: manager.fork(Sequence([1], 4), Sequence([])),
                      "not allocated")
    _expect_no_change(manager, SequenceStateError, lambda: manager.fork(running, child), "already allocated")
    _expect_no_change(manager, SequenceStateError, lambda: manager.fork(running, running), "already allocated")


def test_allocate_twice_empty_or_with_the_wrong_block_size(busy):
    manager, running, _ = busy
    _expect_no_change(manager, SequenceStateError, lambda: manager.allocate(running), "already allocated")
    _expect_no_change(manager, InvalidArgumentError, lambda: manager.allocate(Sequence([], 4)), "no tokens")
    _expect_no_change(manager, InvalidArgumentError, lambda: manager.allocate(Sequence([1], 8)), "block_size")


def test_allocate_without_room_raises_and_changes_nothing(busy):
    manager = busy[0]
    seq = Sequence(range(100, 200), 4)
    _expect_no_change(manager, OutOfBlocksError, lambda: manager.allocate(seq), "free blocks")
    assert seq.block_table == () and seq.num_cached_tokens == 0


def test_append_without_room_raises_and_changes_nothing(busy):
    manager, running, _ = busy
    running.append_token(7)
    _expect_no_change(manager, OutOfBlocksError, lambda: manager.append_slots(running, 100), "free blocks")


def test_swap_misuse(busy):
    manager, running, _ = busy
    _expect_no_change(manager, SequenceStateError, lambda: manager.swap_in(running), "not swapped out")
    manager.swap_out(running)
    _expect_no_change(manager, SequenceStateError, lambda: manager.swap_out(running), "swapped out")
    _expect_no_change(manager, SequenceStateError, lambda: manager.append_slots(running), "swapped out")
    _expect_no_change(manager, SequenceStateError, lambda: manager.slot_mapping(running, 0, 1), "swapped out")


@pytest.mark.parametrize("call, match", [
    (lambda m, s: m.ref_count(12), "block id"), (lambda m, s: m.ref_count(-1), "block id"),
    (lambda m, s: m.block_hash("3"), "block id"), (lambda m, s: m.cpu_ref_count(4), "CPU block id"),
    (lambda m, s: m.slot_mapping(s, 0, 13), "start <= end"), (lambda m, s: m.slot_mapping(s, 3, 2), "start <= end"),
    (lambda m, s: m.slot_mapping(s, True, 3), "start must be an int"),
    (lambda m, s: m.can_allocate(Sequence([1], 4), -1), "num_lookahead_slots"),
    (lambda m, s: m.append_slots(s, -2), "num_lookahead_slots"),
])
def test_out_of_range_arguments(busy, call, match):
    manager, running, _ = busy
    _expect_no_change(manager, InvalidArgumentError, lambda: call(manager, running), match)


def test_a_failing_hash_fn_changes_nothing():
    def hash_fn(parent, tokens):
        if 13 in tokens:
            raise RuntimeError("boom")
        return hash((parent, tokens))

    manager = BlockManager(8, block_size=2, hash_fn=hash_fn)
    parent = allocated(manager, [1, 2, 3])
    _expect_no_change(manager, InvalidArgumentError, lambda: manager.allocate(Sequence([1, 2, 13, 14, 5], 2)),
                      "hash_fn raised RuntimeError: boom")
    child = Sequence([])
    manager.fork(parent, child)
    parent.append_token(13)   # fills the shared partial block: a copy-on-write and a seal, whose hash fails
    table = parent.block_table
    _expect_no_change(manager, InvalidArgumentError, lambda: manager.append_slots(parent), "boom")
    assert parent.block_table == table
    _expect_no_change(manager, InvalidArgumentError,
                      lambda: BlockManager(8, 2, hash_fn=lambda p, t: "x").allocate(Sequence([1, 2], 2)), "int")


def test_errors_are_kvlab_errors_and_builtin_ones():
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(SequenceStateError, RuntimeError)
    assert all(issubclass(e, KvlabError) for e in (InvalidArgumentError, SequenceStateError, OutOfBlocksError))


def _misfile_a_cached_block(policy):
    block = next(iter(policy._cached))
    policy._cached.discard_many([block])
    policy._uncached.add_many([block])


def _sealed(pool, used):
    return [b for b in range(pool.num_blocks) if pool.index.content[b] > 0 and (pool.ref[b] > 0) == used]


def _give_a_used_block_another_salt(pool):
    pool.index.block_bytes[_sealed(pool, used=True)[0]] += b"S" + encode_key("tenant-b")


def _merge_two_contents(pool):
    first, second = _sealed(pool, used=False)[:2]
    pool.index.content[second] = pool.index.content[first]


@pytest.mark.parametrize("corrupt, match", [
    (lambda m: m._pool.ref.__setitem__(0, m._pool.ref[0] + 1), "ref count"),
    (lambda m: m._pool.policy.add(0, False), "free"),
    (lambda m: m._pool.index.cached.__setitem__(12345, 11), "prefix cache"),
    (lambda m: m._swap._link(0, 3), "twin"),
    (lambda m: m._pool.index.registered.__setitem__(11, True), "registered flag"),
    (lambda m: _misfile_a_cached_block(m._pool.policy), "filed as cached"),
    (lambda m: m._swap.ref.__setitem__(1, 1), "CPU block"),
    (lambda m: m._pool.__setattr__("num_free", m._pool.num_free + 1), "miscounts"),
    (lambda m: _give_a_used_block_another_salt(m._pool), "holds other bytes"),
    (lambda m: _merge_two_contents(m._pool), "has content id"),
])
def test_check_invariants_catches_corruption(busy, corrupt, match):
    manager = busy[0]
    manager.check_invariants()
    corrupt(manager)
    with pytest.raises(InvariantViolation, match=match):
        manager.check_invariants()


def test_an_unpickled_copy_is_not_the_allocated_sequence(busy):
    import pickle

    manager, running, _ = busy
    running.append_token(3)
    manager.append_slots(running)
    copy = pickle.loads(pickle.dumps(running))
    copy.append_token(4)
    _expect_no_change(manager, SequenceStateError, lambda: manager.append_slots(copy), "unpickled copy")
    _expect_no_change(manager, SequenceStateError, lambda: manager.free(copy), "unpickled copy")
