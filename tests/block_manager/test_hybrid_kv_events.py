"""KV cache events of a hybrid manager: every group's, tagged with its group, exact per group.

The property test reuses the hybrid model-checking machine of test_stateful_hybrid (chunked admissions with
prefix hits in every group, steps, forks, frees, swaps, resets, constant hashes, a user policy) and checks
after every operation that the (group, hash) pairs rebuilt from the events are the manager's own: each group's
namespace of the prefix index (the same hash may be cached in several groups), with every cached block a
group's sequences hold in that group's namespace. A
healthy subscriber checks at every event that the whole call is over (the hybrid manager's invariants hold,
no manager's lock is held); faulty subscribers ahead of it (raising, or closing themselves, at a random
event) never cost it an event.
"""

import io
import json

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import initialize, invariant
from test_kv_events import Faulty
from test_stateful_hybrid import MACHINES, STEPS

from kvlab import BlockManager, Sequence
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedHashes, event_dict
from kvlab.blocks.sequence import SequenceStatus

FULL, W2 = FullAttentionSpec(), SlidingWindowSpec(2)


def cached_pairs(manager: HybridBlockManager) -> set:
    """The manager's own answer, from its pool: the (group, hash) of every cached block. Checked against the
    groups' records too: a cached block a group's sequence holds is cached in that group's namespace."""
    index = manager._pool.index
    pairs = {(g, h) for g, namespace in enumerate(index.namespaces) for h in namespace}
    assert len(pairs) == index.num_cached == sum(index.registered)
    for g, group in enumerate(manager._groups):
        for alloc in group.records.values():
            if not alloc.on_cpu:
                assert all(index.namespaces[g].get(index.hash[b]) == b for b in alloc.table if index.is_cached(b))
    return pairs


class Consistent:
    """A subscriber that checks, at every event, that the call which produced it is over."""

    def __init__(self, manager, index):
        self.manager, self.index = manager, index

    def __call__(self, event):
        manager = self.manager
        assert not manager._lock._is_owned(), "an event was delivered during a hybrid manager call"
        manager.check_invariants()
        self.index(event)


def _event_machine(machine):
    class EventMachine(machine):
        """Subscribed in this order: the faulty subscribers, then the healthy index and buffer."""
        config = {**machine.config, "kv_events": True}

        def __init__(self):
            super().__init__()
            self.replayed, self.unchecked, self.faulty, self.healthy = CachedHashes(), iter(()), [], None

        @initialize(breaks_at=st.lists(st.tuples(st.integers(1, 12), st.sampled_from(["raise", "close"])),
                                       max_size=3))
        def subscribe(self, breaks_at):
            for at, how in breaks_at:
                faulty = Faulty(at, how)
                faulty.subscription = self.manager.kv_events.subscribe(faulty)
                self.faulty.append(faulty)
            self.healthy = self.manager.kv_events.subscribe(Consistent(self.manager, self.replayed))
            self.unchecked = self.manager.kv_events.subscribe()

        @invariant()
        def every_event_arrived_after_its_call(self):
            assert self.healthy.error is None and not self.healthy.closed   # Consistent's checks never failed

        @invariant()
        def events_rebuild_every_groups_cached_hashes(self):
            pairs = {(g, h) for g, group_hashes in self.replayed.groups.items() for h in group_hashes}
            assert not self.replayed.hashes   # every hybrid event names its group
            assert pairs == cached_pairs(self.manager)

        @invariant()
        def faulty_subscribers_are_dropped_when_they_break_and_only_then(self):
            for faulty in self.faulty:
                broke = faulty.seen >= faulty.at
                assert faulty.subscription.closed == broke and faulty.seen <= faulty.at

        @invariant()
        def events_describe_their_group(self):
            specs = self.manager.groups
            for event in self.unchecked:
                if type(event) is BlockStored:
                    spec = specs[event.group_idx]
                    assert event.kv_cache_spec_sliding_window == spec.sliding_window
                    assert event.kv_cache_spec_kind == ("full_attention" if spec.sliding_window is None
                                                        else "sliding_window")
                    assert len(event.token_ids) == self.manager.block_size * len(event.block_hashes)
                elif type(event) is BlockRemoved:
                    assert 0 <= event.group_idx < len(specs)

    EventMachine.__name__ = f"Events{machine.__name__}"
    return EventMachine


# (groups of different block sizes refuse kv_events: a BlockStored names one block size)
for _machine_class in map(_event_machine, [m for m in MACHINES if "group_block_sizes" not in m.config]):
    _case = _machine_class.TestCase
    _case.settings = settings(stateful_step_count=STEPS, deadline=None)
    _case = pytest.mark.filterwarnings("ignore::kvlab.errors.KVEventSubscriberWarning")(_case)
    globals()[f"Test{_machine_class.__name__}"] = _case
del _case


def group_fields(event: BlockStored) -> tuple:
    return event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window


def test_a_prompt_is_stored_in_every_group_with_its_spec():
    manager, index = HybridBlockManager(16, 2, groups=[FULL, W2], kv_events=True), CachedHashes()
    manager.kv_events.subscribe(index)
    with manager.kv_events.subscribe() as events:
        manager.allocate(Sequence([1, 2, 3, 4, 5], 2))
        full, window = list(events)
    assert group_fields(full) == (0, "full_attention", None) and group_fields(window) == (1, "sliding_window", 2)
    assert full.token_ids == window.token_ids == [1, 2, 3, 4]
    # vLLM's events: the plain block hash, the same in every group, and the group beside it.
    assert full.block_hashes == window.block_hashes
    assert index.groups == {0: set(full.block_hashes), 1: set(full.block_hashes)}
    assert index.prefix_match(full.block_hashes, 2, group=0) == index.prefix_match(full.block_hashes, 2, 1) == 2
    line = json.loads(json.dumps(event_dict(window)))
    assert {k: line[k] for k in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")} == \
        {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 2}


def test_eviction_removes_each_block_from_its_own_group():
    manager, index = HybridBlockManager(8, 2, groups=[FULL, W2], kv_events=True), CachedHashes()
    manager.kv_events.subscribe(index)
    with manager.kv_events.subscribe() as events:
        first = Sequence([1, 2, 3, 4, 5], 2)
        manager.allocate(first)
        stored = {e.group_idx: e.block_hashes for e in events}
        manager.free(first)
        manager.allocate(Sequence([7] * 5, 2))   # needs more blocks than the 3 uncached: evicts cached ones
        removed = [e for e in events if type(e) is BlockRemoved]
    assert removed
    for event in removed:
        assert set(event.block_hashes) <= set(stored[event.group_idx])
    gone = {(e.group_idx, h) for e in removed for h in e.block_hashes}
    assert not any((g, h) in gone for g, hashes in index.groups.items() for h in hashes)
    assert {(g, h) for g in stored for h in stored[g]} - gone <= \
        {(g, h) for g, hashes in index.groups.items() for h in hashes}


def test_reset_clears_every_group():
    manager, index = HybridBlockManager(16, 2, groups=[W2, FULL], kv_events=True), CachedHashes()
    manager.kv_events.subscribe(index)
    seq = Sequence([1, 2, 3, 4, 5], 2)
    manager.allocate(seq)
    assert set(index.groups) == {0, 1}
    manager.free(seq)
    with manager.kv_events.subscribe() as events:
        assert manager.reset_prefix_cache()
        assert list(events) == [AllBlocksCleared()]
    assert all(not hashes for hashes in index.groups.values())


def test_events_arrive_after_the_whole_hybrid_call():
    """A member's own call ends before the hybrid call does: its events must wait for the hybrid call."""
    manager, seen = HybridBlockManager(16, 2, groups=[FULL, W2], kv_events=True), []
    seq = Sequence([1, 2, 3, 4, 5], 2)

    def check(event):
        manager.check_invariants()
        assert not manager._lock._is_owned()
        seen.append((event.group_idx, seq.status))

    manager.kv_events.subscribe(check)
    manager.allocate(seq)
    assert seen == [(0, SequenceStatus.RUNNING), (1, SequenceStatus.RUNNING)]   # set by the hybrid call's end


def test_a_callback_may_call_the_hybrid_manager():
    manager, index = HybridBlockManager(16, 2, groups=[FULL, W2], kv_events=True), CachedHashes()
    follow_up, calls = Sequence([9, 9, 9], 2), []

    def allocate_once(event):
        if type(event) is BlockStored and event.group_idx == 1 and not calls:
            calls.append(event)
            manager.allocate(follow_up)   # its events come after the current ones, never nested

    manager.kv_events.subscribe(allocate_once)
    manager.kv_events.subscribe(index)
    manager.allocate(Sequence([1, 2, 3, 4, 5], 2))
    pairs = cached_pairs(manager)
    assert {(g, h) for g, hashes in index.groups.items() for h in hashes} == pairs and len(pairs) == 6


def test_single_group_lines_are_unchanged():
    """A single-group manager's JSONL lines, byte for byte as before groups existed (no group fields)."""
    manager, out = BlockManager(2, 2, kv_events=True), io.StringIO()
    with manager.kv_events.write_jsonl(out):
        first = Sequence([1, 2, 3], 2)
        manager.allocate(first)
        manager.free(first)
        manager.allocate(Sequence([5, 6, 7], 2))
    stored, removed, stored_again = out.getvalue().splitlines()
    assert stored == ('{"type": "BlockStored", "block_hashes": [%d], "parent_block_hash": null, "token_ids": [1, 2], '
                      '"block_size": 2, "lora_id": null, "medium": "GPU", "lora_name": null, "extra_keys": null}'
                      % json.loads(stored)["block_hashes"][0])
    hashes = json.loads(stored)["block_hashes"]
    assert removed == '{"type": "BlockRemoved", "block_hashes": %s, "medium": "GPU"}' % hashes
    assert json.loads(stored_again)["token_ids"] == [5, 6]
