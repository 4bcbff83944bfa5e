"""A KV-event subscriber can never hurt the manager or another subscriber (kvlab.blocks.events, "Delivery").

Events are delivered after the manager call's whole state change, each to every subscriber in order; a
subscriber that raises is dropped with a warning (its exception kept in ``subscription.error``) while the
call returns normally; ``write_jsonl`` checks its target when it is called. The model-checking version (random
programs with a subscriber that raises at a random event and one that closes itself) is in test_kv_events.
"""

import io
import os

import pytest

from kvlab import BlockManager, InvalidArgumentError, Sequence
from kvlab.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedHashes
from kvlab.errors import KVEventSubscriberWarning


def raising_on(event_type):
    def callback(event):
        if type(event) is event_type:
            raise RuntimeError(f"subscriber broke on {event_type.__name__}")
    return callback


def cached_hashes(manager):
    return {manager.block_hash(b) for b in range(manager.num_blocks) if manager.is_cached(b)}


def test_a_subscriber_raising_on_stored_leaves_the_allocation_whole_and_the_next_subscriber_served():
    m, s = BlockManager(8, 4, kv_events=True), Sequence(range(1, 10), 4)
    broken = m.kv_events.subscribe(raising_on(BlockStored))
    index = CachedHashes()
    m.kv_events.subscribe(index)
    with pytest.warns(KVEventSubscriberWarning, match="BlockStored.*dropped"):
        m.allocate(s)
    m.check_invariants()
    assert s.block_table == (0, 1, 2) and m.num_free_blocks == 5
    assert index.hashes == cached_hashes(m) and len(index.hashes) == 2
    assert broken.closed and isinstance(broken.error, RuntimeError)
    m.free(s)
    m.allocate(Sequence(range(1, 10), 4))  # the dropped subscriber is not called again: no second warning
    m.check_invariants()


def test_a_subscriber_raising_on_removed_during_an_evicting_allocate():
    m, index = BlockManager(4, 2, kv_events=True), CachedHashes()
    m.kv_events.subscribe(raising_on(BlockRemoved))
    m.kv_events.subscribe(index)
    first = Sequence([1, 2, 3, 4, 5], 2)
    m.allocate(first)
    m.free(first)
    other = Sequence([8] * 7, 2)  # needs all four blocks: evicts both cached ones
    with pytest.warns(KVEventSubscriberWarning, match="BlockRemoved"):
        m.allocate(other)
    m.check_invariants()
    assert len(other.block_table) == 4 and index.hashes == cached_hashes(m)


def test_a_subscriber_raising_on_cleared_does_not_keep_the_event_from_the_next_one():
    m, index = BlockManager(8, 4, kv_events=True), CachedHashes()
    m.kv_events.subscribe(raising_on(AllBlocksCleared))
    m.kv_events.subscribe(index)
    s = Sequence(range(1, 10), 4)
    m.allocate(s)
    m.free(s)
    assert len(index.hashes) == 2
    with pytest.warns(KVEventSubscriberWarning):
        assert m.reset_prefix_cache()
    assert index.hashes == set() == cached_hashes(m)


def test_a_subscriber_that_closes_itself_or_another_mid_delivery():
    m = BlockManager(8, 2, kv_events=True)
    got = {name: [] for name in "abc"}
    subscriptions = {}

    def a(event):
        got["a"].append(event)
        subscriptions["a"].close()  # itself: b must still get this event
        subscriptions["c"].close()  # a later one: c gets nothing from now on

    subscriptions["a"] = m.kv_events.subscribe(a)
    subscriptions["b"] = m.kv_events.subscribe(got["b"].append)
    subscriptions["c"] = m.kv_events.subscribe(got["c"].append)
    m.allocate(Sequence([1, 2, 3, 4, 5], 2))
    m.allocate(Sequence([7, 7, 7], 2))
    assert len(got["a"]) == 1 and got["c"] == [] and len(got["b"]) == 2
    assert all(s.closed and s.error is None for s in (subscriptions["a"], subscriptions["c"]))
    subscriptions["a"].close()  # closing twice is harmless


def test_events_arrive_after_the_state_change_and_a_subscriber_may_call_the_manager():
    m = BlockManager(8, 2, kv_events=True)
    seen, index = [], CachedHashes()
    s = Sequence([1, 2, 3, 4, 5], 2)

    def inspector(event):
        m.check_invariants()  # never half an operation
        seen.append((type(event).__name__, s.block_table, m.num_free_blocks))
        if len(seen) == 1:
            m.allocate(Sequence([9, 9, 9], 2))  # its own event is delivered after this one, to everyone

    m.kv_events.subscribe(inspector)
    m.kv_events.subscribe(index)
    m.allocate(s)
    assert seen == [("BlockStored", (0, 1, 2), 5), ("BlockStored", (0, 1, 2), 3)]
    assert index.hashes == cached_hashes(m) and len(index.hashes) == 3


def test_a_failed_call_publishes_nothing():
    m = BlockManager(2, 2, kv_events=True)
    with m.kv_events.subscribe() as events:
        with pytest.raises(Exception):
            m.allocate(Sequence([1, 2, 3, 4, 5, 6], 2))
        assert list(events) == []


@pytest.mark.parametrize("make", [
    lambda tmp: _closed_file(tmp),
    lambda tmp: open(tmp / "events.bin", "wb"),
    lambda tmp: io.BytesIO(),
    lambda tmp: open(tmp / "existing.txt", "r"),
], ids=["closed", "binary-file", "bytes-io", "read-only"])
def test_write_jsonl_refuses_a_file_it_cannot_write_text_to_and_subscribes_nothing(tmp_path, make):
    (tmp_path / "existing.txt").write_text("")
    m, target = BlockManager(8, 4, kv_events=True), make(tmp_path)
    with pytest.raises(InvalidArgumentError, match="write_jsonl"):
        m.kv_events.write_jsonl(target)
    assert m.kv_events._subscriptions == []
    m.allocate(Sequence(range(1, 10), 4))
    m.check_invariants()


def _closed_file(tmp):
    file = open(tmp / "closed.jsonl", "w")
    file.close()
    return file


@pytest.mark.parametrize("target", ["/proc/x.jsonl", "/nonexistent_dir/x.jsonl", "DIR", None, 3.5, 4, True,
                                    b"/tmp/x.jsonl", ""])
def test_write_jsonl_refuses_a_bad_path_before_subscribing(tmp_path, target):
    m = BlockManager(8, 4, kv_events=True)
    if target == "DIR":
        target = tmp_path
    read_end, write_end = os.pipe()  # an open descriptor: write_jsonl(4) must neither write to nor close one
    try:
        with pytest.raises(InvalidArgumentError, match="write_jsonl"):
            m.kv_events.write_jsonl(write_end if target == 4 else target)
        m.allocate(Sequence(range(1, 10), 4))
        os.write(write_end, b"still open")  # raises OSError if write_jsonl closed it
        assert os.read(read_end, 100) == b"still open"  # and nothing else was written to it
    finally:
        os.close(read_end)
        os.close(write_end)
    assert m.kv_events._subscriptions == []


def test_a_jsonl_file_that_fails_later_is_dropped_and_the_manager_carries_on(tmp_path):
    m, index = BlockManager(8, 4, kv_events=True), CachedHashes()
    file = open(tmp_path / "events.jsonl", "w")
    writer = m.kv_events.write_jsonl(file)
    m.kv_events.subscribe(index)
    file.close()  # e.g. the disk went away
    with pytest.warns(KVEventSubscriberWarning, match="ValueError"):
        m.allocate(Sequence(range(1, 10), 4))
    m.check_invariants()
    assert writer.closed and isinstance(writer.error, ValueError) and index.hashes == cached_hashes(m)
