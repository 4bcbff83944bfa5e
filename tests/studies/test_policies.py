"""FIFO and LFU eviction (with the lead's LRU beside them): victims checked by hand, then against plain
reference models on random operation sequences, then inside the real BlockManager."""

import numpy as np
import pytest

from kvlab import AllocStatus, BlockManager, Sequence
from kvlab.blocks.eviction import POLICIES, FIFOPolicy, LFUPolicy, LRUPolicy
from kvlab.errors import OutOfBlocksError


def scenario(policy):
    """Blocks 0-5 start never-cached. Request X takes 0, 1 and request Y takes 2, 3 (in that pop order);
    block 2 is hit twice and block 0 once; Y frees tail first (3, 2), then X (1, 0)."""
    for block in range(6):
        policy.add(block, False)
    assert [policy.pop() for _ in range(4)] == [0, 1, 2, 3]
    for block in (2, 2, 0):
        policy.on_hit(block)
    for block in (3, 2, 1, 0):
        policy.add(block, True)
    return policy


@pytest.mark.parametrize("cls, cached_victims", [
    (LRUPolicy, [3, 2, 1, 0]),   # least recently freed first
    (FIFOPolicy, [0, 1, 2, 3]),  # oldest content (popped first) first, hits or not
    (LFUPolicy, [3, 1, 0, 2]),   # fewest hits (3: 0, 1: 0, 0: 1, 2: 2), ties least recently freed
])
def test_victims_by_hand(cls, cached_victims):
    policy = scenario(cls())
    assert list(policy) == [4, 5, *cached_victims]              # iteration shows the reuse order
    assert [policy.pop() for _ in range(6)] == [4, 5, *cached_victims]  # never-cached blocks go first
    with pytest.raises(OutOfBlocksError):
        policy.pop()


@pytest.mark.parametrize("cls, expected", [(LRUPolicy, [3, 2, 0, 1]), (FIFOPolicy, [0, 1, 2, 3])])
def test_a_hit_refreshes_lru_but_not_fifo(cls, expected):
    policy = scenario(cls())
    assert policy.pop_many(2) == [4, 5]    # the never-cached blocks
    policy.remove(1)                       # a prompt hits free block 1 and takes it back ...
    policy.add(1, True)                    # ... and frees it again
    assert [policy.pop() for _ in range(4)] == expected


def test_lfu_counts_reset_when_a_block_gets_new_content():
    policy = LFUPolicy()
    for block in range(2):
        policy.add(block, False)
    assert policy.pop_many(2) == [0, 1]
    for block in (0,) * 5 + (1,) * 2:
        policy.on_hit(block)
    policy.add(0, False)                   # freed without a registered prefix ...
    assert policy.pop() == 0               # ... so reused first, for new content: its 5 hits are gone
    policy.add(0, True)
    policy.add(1, True)
    assert list(policy) == [0, 1]          # 0 hits before 2 hits (with 5 kept, the order would flip)


@pytest.mark.parametrize("cls", [FIFOPolicy, LFUPolicy])
def test_pop_many_refuses_more_than_the_free_blocks_and_changes_nothing(cls):
    policy = cls()
    for block in range(3):
        policy.add(block, False)
    with pytest.raises(OutOfBlocksError):
        policy.pop_many(4)
    assert list(policy) == [0, 1, 2] and len(policy) == 3


class ReferenceModel:
    """O(n) reference: never-cached blocks in arrival order, then cached blocks by an explicit priority."""

    def __init__(self, kind):
        self.kind, self.uncached, self.cached = kind, [], {}
        self.clock, self.born, self.hits = 0, {}, {}

    def add(self, block, cached):
        self.clock += 1
        if not cached:
            self.uncached.append(block)
        elif self.kind == "fifo":
            self.cached[block] = self.born.get(block, 0)
        else:
            self.cached[block] = (self.hits.get(block, 0), self.clock)

    def remove(self, block):
        if block in self.cached:
            del self.cached[block]
        else:
            self.uncached.remove(block)

    def on_hit(self, block):
        self.hits[block] = self.hits.get(block, 0) + 1

    def pop(self):
        self.clock += 1
        block = self.uncached.pop(0) if self.uncached else min(self.cached, key=self.cached.get)
        self.cached.pop(block, None)
        self.born[block], self.hits[block] = self.clock, 0
        return block


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["fifo", "lfu"])
def test_matches_a_plain_reference_on_random_operations(kind, seed):
    rng = np.random.default_rng(seed)
    policy, reference = POLICIES[kind](), ReferenceModel(kind)
    num_blocks = int(rng.integers(5, 40))
    in_use = []
    for block in range(num_blocks):
        policy.add(block, False)
        reference.add(block, False)
    free_cached = set()
    for _ in range(600):
        op = rng.integers(4)
        if op == 0 and len(policy):                  # take a block for new content
            block = policy.pop()
            assert block == reference.pop()
            free_cached.discard(block)
            in_use.append(block)
        elif op == 1 and in_use:                     # free a block, cached or not
            block = in_use.pop(int(rng.integers(len(in_use))))
            cached = bool(rng.integers(2))
            policy.add(block, cached)
            reference.add(block, cached)
            if cached:
                free_cached.add(block)
        elif op == 2 and free_cached:                # a prefix hit takes a free cached block back
            block = sorted(free_cached)[int(rng.integers(len(free_cached)))]
            for model in (policy, reference):
                model.on_hit(block)
                model.remove(block)
            free_cached.discard(block)
            in_use.append(block)
        elif op == 3 and in_use:                     # a hit on a block in use
            block = in_use[int(rng.integers(len(in_use)))]
            policy.on_hit(block)
            reference.on_hit(block)
        assert len(policy) == len(reference.uncached) + len(reference.cached)
    assert list(policy) == [reference.pop() for _ in range(len(policy))]


@pytest.mark.parametrize("seed", range(6))
def test_lru_batches_skip_the_entries_of_revived_blocks(seed):
    """Hits revive free blocks, leaving stale entries in the middle of the LRU queues; a block freed again
    gets a new entry behind them. Batch pops (as the manager makes them) must skip exactly the stale ones:
    checked against plain lists, never-cached blocks first, then cached ones least recently freed first."""
    rng = np.random.default_rng(seed)
    policy, uncached, cached = LRUPolicy(), [], []
    in_use = list(range(int(rng.integers(8, 40))))
    for _ in range(400):
        op = rng.integers(3)
        if op == 0 and in_use:                       # free a few blocks, cached or not
            for _ in range(int(rng.integers(1, len(in_use) + 1))):
                block, is_cached = in_use.pop(int(rng.integers(len(in_use)))), bool(rng.integers(2))
                policy.add_many([block], [is_cached])
                (cached if is_cached else uncached).append(block)
        elif op == 1 and cached:                     # prefix hits take free cached blocks back
            for _ in range(int(rng.integers(1, len(cached) + 1))):
                block = cached.pop(int(rng.integers(len(cached))))
                policy.remove(block)
                in_use.append(block)
        elif op == 2 and len(policy):                # a prompt takes a batch for new content
            count = int(rng.integers(len(policy) + 1))
            expected = (uncached + cached)[:count]
            assert policy.pop_many(count) == expected
            from_uncached = min(count, len(uncached))
            del uncached[:from_uncached], cached[:count - from_uncached]
            in_use += expected
        assert len(policy) == len(uncached) + len(cached)
    assert list(policy) == uncached + cached


def prompt(first_token, block_size=2):
    """Two full blocks of fresh tokens plus one token in a partial third block (5 tokens)."""
    return list(range(first_token, first_token + 2 * block_size + 1))


@pytest.mark.parametrize("policy, evicted", [("lru", "A tail"), ("fifo", "A head"), ("lfu", "B tail")])
def test_the_policies_evict_different_prefixes_in_the_block_manager(policy, evicted):
    """Prompts A, A again (its blocks get a hit), B, then C needs one block more than the never-cached
    ones: LRU evicts A's tail (A was freed before B), FIFO evicts A's head (filled first), LFU evicts
    B's tail (B was never hit)."""
    manager = BlockManager(6, 2, eviction=policy)
    tables = {}
    for name, tokens in (("A", prompt(0)), ("A", prompt(0)[:4] + [99]), ("B", prompt(100)), ("C", prompt(200))):
        seq = Sequence(tokens, 2)
        manager.allocate(seq)
        tables.setdefault(name, seq.block_table[:2])
        manager.free(seq)
    assert manager.num_evictions == 1
    head_tail = {"A head": tables["A"][0], "A tail": tables["A"][1], "B head": tables["B"][0],
                 "B tail": tables["B"][1]}
    assert {name for name, block in head_tail.items() if not manager.is_cached(block)} == {evicted}
    manager.check_invariants()


@pytest.mark.parametrize("policy", ["fifo", "lfu"])
def test_the_manager_stays_consistent_under_each_policy(policy):
    rng = np.random.default_rng(7)
    manager, live = BlockManager(24, 4, eviction=policy), []
    for _ in range(200):
        if live and (rng.random() < 0.45 or manager.num_free_blocks < 8):
            manager.free(live.pop(int(rng.integers(len(live)))))
        else:
            length = int(rng.integers(1, 20))
            base = int(rng.choice([0, 1000, 2000]))    # three shared stems, so prefixes hit and get evicted
            seq = Sequence(np.arange(base, base + length) + (length % 3 == 0) * 50_000, 4)
            if manager.can_allocate(seq) is AllocStatus.OK:
                manager.allocate(seq)
                live.append(seq)
        manager.check_invariants()
    assert manager.num_evictions > 0 and manager.stats.hit_blocks > 0
