"""KV cache events (vLLM's schema) are exact: a subscriber that replays them knows what the manager caches.

The property test reuses the model-checking machine of test_stateful (allocations with prefix hits,
decode steps, forks, frees, swaps, resets, every eviction policy, weak and constant hashes, sliding windows)
and checks after every operation that the hashes rebuilt from the events equal the manager's own cached
hashes, and that every stored event's hashes follow from its parent hash and token ids. Faulty subscribers
ahead of the healthy one (raising, or closing themselves, at a random event) never cost it an event, and
the manager's invariants (checked by the base machine after every operation) hold whatever they do.
"""

import io
import json

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import settings
from hypothesis.stateful import initialize, invariant
from test_stateful import MACHINES, STEPS, ManagerMachine

from kvlab import BlockManager, InvalidArgumentError, Sequence
from kvlab.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedHashes, event_dict


def cached_hashes(manager: BlockManager) -> set:
    """The manager's own answer, from its public per-block queries."""
    return {manager.block_hash(b) for b in range(manager.num_blocks) if manager.is_cached(b)}


def chained(parent, token_ids, block_size, extra_keys=None) -> list:
    """kvlab's default block hashes (xxh64 of int64 tokens, then a keyed block's encoded keys as the events give
    them in hex, seeded with the parent's hash)."""
    hashes = []
    for i, start in enumerate(range(0, len(token_ids), block_size)):
        raw = b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids[start:start + block_size])
        raw += bytes.fromhex(extra_keys[i] or "") if extra_keys else b""
        parent = xxhash.xxh64_intdigest(raw, parent or 0)
        hashes.append(parent)
    return hashes


class Faulty:
    """A subscriber that breaks at its ``at``-th event: raises, or closes its own subscription."""

    def __init__(self, at: int, how: str):
        self.at, self.how, self.seen, self.subscription = at, how, 0, None

    def __call__(self, event):
        self.seen += 1
        if self.seen == self.at:
            if self.how == "raise":
                raise RuntimeError("a broken subscriber")
            self.subscription.close()


class EventMachine(ManagerMachine):
    """Subscribed in this order: faulty subscribers (raising or closing themselves at a random event), then
    the healthy index and buffer, which must still see every event, so they come after the faulty ones."""

    def __init__(self):
        super().__init__()
        self.replayed, self.unchecked, self.faulty = CachedHashes(), iter(()), []

    @initialize(breaks_at=st.lists(st.tuples(st.integers(1, 12), st.sampled_from(["raise", "close"])), max_size=3))
    def subscribe(self, breaks_at):
        for at, how in breaks_at:
            faulty = Faulty(at, how)
            faulty.subscription = self.manager.kv_events.subscribe(faulty)
            self.faulty.append(faulty)
        self.manager.kv_events.subscribe(self.replayed)
        self.unchecked = self.manager.kv_events.subscribe()

    # Hypothesis checks invariants after every rule: the sets are compared after every operation.
    @invariant()
    def events_rebuild_the_cached_hashes(self):
        assert self.replayed.hashes == cached_hashes(self.manager)

    @invariant()
    def faulty_subscribers_are_dropped_when_they_break_and_only_then(self):
        for faulty in self.faulty:
            broke = faulty.seen >= faulty.at
            assert faulty.subscription.closed == broke and faulty.seen <= faulty.at
            assert isinstance(faulty.subscription.error, RuntimeError) == (broke and faulty.how == "raise")

    @invariant()
    def stored_blocks_chain_from_their_parent(self):
        bs = self.manager.block_size
        for event in self.unchecked:
            if type(event) is BlockStored:
                assert event.block_size == bs and event.medium == "GPU" and event.lora_id is None
                assert len(event.token_ids) == bs * len(event.block_hashes)
                if self.manager.hash_fn is None:
                    assert event.block_hashes == chained(event.parent_block_hash, event.token_ids, bs, event.extra_keys)
            else:
                assert type(event) in (BlockRemoved, AllBlocksCleared)


EVENT_MACHINES = [type(f"Events{m.__name__}", (EventMachine,), {"config": {**m.config, "kv_events": True}})
                  for m in MACHINES]
for _machine_class in EVENT_MACHINES:
    _case = _machine_class.TestCase
    _case.settings = settings(stateful_step_count=STEPS, deadline=None)
    # The faulty subscribers' drops warn by design (test_kv_event_subscribers checks the warning).
    _case = pytest.mark.filterwarnings("ignore::kvlab.errors.KVEventSubscriberWarning")(_case)
    globals()[f"Test{_machine_class.__name__}"] = _case
del _case


def test_a_prompt_then_its_next_turn_then_eviction_and_reset():
    manager = BlockManager(4, 2, kv_events=True)
    with manager.kv_events.subscribe() as events:
        first = Sequence([1, 2, 3, 4, 5], 2)
        manager.allocate(first)
        manager.free(first)
        [stored] = list(events)
        assert stored.block_hashes == chained(None, [1, 2, 3, 4], 2) and stored.parent_block_hash is None
        assert stored.token_ids == [1, 2, 3, 4]
        turn = Sequence([1, 2, 3, 4, 9, 9, 7], 2)  # hits both blocks, stores the third after them
        manager.allocate(turn)
        [stored] = list(events)
        assert stored.parent_block_hash == chained(None, [1, 2, 3, 4], 2)[-1]
        assert stored.block_hashes == chained(None, [1, 2, 3, 4, 9, 9], 2)[2:]
        manager.free(turn)
        other = Sequence([8] * 7, 2)  # needs all four blocks: evicts the three cached ones
        manager.allocate(other)
        removed = [e for e in events if type(e) is BlockRemoved]
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(chained(None, [1, 2, 3, 4, 9, 9], 2))
        manager.free(other)
        assert manager.reset_prefix_cache()
        assert list(events) == [AllBlocksCleared()]
    manager.allocate(Sequence([5, 5, 5], 2))
    assert list(events) == []  # closed: nothing more arrives


def test_jsonl_lines_are_vllm_tagged_structs():
    manager, out = BlockManager(8, 2, kv_events=True), io.StringIO()
    with manager.kv_events.write_jsonl(out):
        manager.allocate(Sequence([1, 2, 3], 2))
        manager.reset_prefix_cache()  # refused while blocks are in use: no event
    [line] = out.getvalue().splitlines()
    assert json.loads(line) == {"type": "BlockStored", "block_hashes": chained(None, [1, 2], 2),
                                "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
                                "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}


def test_salted_blocks_carry_their_keys_and_only_their_tokens():
    manager = BlockManager(8, 2, kv_events=True)
    with manager.kv_events.subscribe() as events:
        manager.allocate(Sequence([1, 2, 3, 4, 5], 2, cache_salt="tenant-a", extra_keys={1: "image"}))
        manager.allocate(Sequence([1, 2, 3, 4, 5], 2))
        salted, plain = list(events)
    assert salted.token_ids == plain.token_ids == [1, 2, 3, 4]
    assert plain.extra_keys is None and len(salted.extra_keys) == 2 and all(salted.extra_keys)
    assert not set(salted.block_hashes) & set(plain.block_hashes)  # tenants never share a block
    assert json.loads(json.dumps(event_dict(salted)))["extra_keys"] == salted.extra_keys


def test_jsonl_to_a_path_is_closed_with_the_subscription(tmp_path):
    manager = BlockManager(8, 2, kv_events=True)
    subscription = manager.kv_events.write_jsonl(tmp_path / "events.jsonl")
    manager.allocate(Sequence([1, 2, 3, 4, 5], 2))
    subscription.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["BlockStored"]


def test_no_publisher_unless_asked_and_callbacks_are_checked():
    assert BlockManager(4, 2).kv_events is None
    with pytest.raises(InvalidArgumentError, match="callable"):
        BlockManager(4, 2, kv_events=True).kv_events.subscribe(42)
