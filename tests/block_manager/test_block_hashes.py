"""A sequence carries its block hashes for its whole life (kvlab.blocks.prefix_cache.BlockHashes): a block is
hashed once, however often the sequence is checked, admitted, preempted and admitted again."""

import pickle

import pytest

from kvlab import BlockManager, Sequence
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks import prefix_cache as hashing


@pytest.fixture
def hashed(monkeypatch):
    """The blocks (token bytes) the default xxh64 hashes, in order."""
    calls = []
    xxh64 = hashing.xxhash.xxh64_intdigest

    def counting(content, seed=0):
        calls.append(content)
        return xxh64(content, seed)

    monkeypatch.setattr(hashing.xxhash, "xxh64_intdigest", counting)
    return calls


def test_a_sequence_preempted_by_recompute_is_not_hashed_again(hashed):
    manager = BlockManager(16, block_size=4)
    seq = Sequence(range(10), 4)
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert len(hashed) == 2                 # its two full blocks, once for can_allocate and allocate together
    seq.append_token(10)
    seq.append_token(11)
    manager.append_slots(seq)               # the decode step fills block 2: only that block is hashed
    assert len(hashed) == 3
    manager.free(seq, preempted=True)
    assert manager.can_allocate(seq)
    manager.allocate(seq)                   # re-admitted: all three blocks' hashes are the ones it kept
    assert len(hashed) == 3
    assert seq.num_cached_tokens == 8       # and they are right: its blocks hit (all but the last token's)
    manager.check_invariants()


def test_a_chunked_prompt_hashes_each_block_once(hashed):
    manager = BlockManager(16, block_size=4)
    seq = Sequence(range(13), 4)
    manager.allocate(seq, num_new_tokens=5)
    manager.append_slots(seq, num_new_tokens=4)
    manager.append_slots(seq)
    assert len(hashed) == 3
    twin = Sequence(range(13), 4)
    manager.allocate(twin)
    assert twin.num_cached_tokens == 12
    manager.check_invariants()


def test_another_managers_hash_fn_is_hashed_afresh():
    calls = []

    def weak_hash(parent, tokens):
        calls.append(tokens)
        return hash((parent, tokens))

    first, second = BlockManager(16, block_size=2), BlockManager(16, block_size=2, hash_fn=weak_hash)
    second.allocate(Sequence([1, 2, 3, 4, 5], 2))
    calls.clear()
    seq = Sequence([1, 2, 3, 4, 5], 2)
    first.allocate(seq)                     # its hashes are xxh64's now
    first.free(seq, preempted=True)
    second.allocate(seq)                    # weak_hash's chain: hashed again, and it hits
    assert calls == [(1, 2), (3, 4)]
    assert seq.num_cached_tokens == 4
    second.check_invariants()


def test_a_fork_child_takes_its_parents_hashes():
    manager = BlockManager(16, block_size=2)
    child = Sequence([7, 7, 7, 7, 7], 2)    # a reused child: its own hashes are of other tokens
    manager.allocate(child)
    manager.free(child)
    parent = Sequence([1, 2, 3], 2, cache_salt="tenant")
    manager.allocate(parent)
    manager.fork(parent, child)
    child.append_token(4)
    manager.append_slots(child)             # seals [3, 4] after [1, 2], with the parent's salt
    manager.free(parent)
    manager.free(child, preempted=True)
    again = Sequence([1, 2, 3, 4, 5], 2, cache_salt="tenant")
    manager.allocate(again)
    assert again.num_cached_tokens == 4     # the child's blocks were sealed under the right hashes...
    manager.allocate(child)
    assert child.num_cached_tokens == 2     # ...and its kept ones are right after a preemption
    manager.check_invariants()


def test_a_hybrid_manager_hashes_a_prompt_once_for_all_groups(hashed):
    manager = HybridBlockManager(32, 2, groups=[FullAttentionSpec(), SlidingWindowSpec(2)])
    seq = Sequence([1, 2, 3, 4, 5], 2)
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert len(hashed) == 2                 # two full blocks, one hash each: a group is a namespace, not bytes
    manager.free(seq, preempted=True)
    manager.allocate(seq)
    seq.append_token(6)
    manager.append_slots(seq)               # seals block [5, 6] in both groups, hashed once
    assert len(hashed) == 3
    child = Sequence([])
    manager.fork(seq, child)
    child.append_token(7)
    child.append_token(8)
    manager.append_slots(child)
    assert len(hashed) == 4                 # [7, 8], once: a fork's group shadows share the child's hashes
    manager.check_invariants()


def test_a_pickled_sequence_leaves_its_hashes_behind():
    """A decoding sequence sent to a worker is a flat-size message: its prompt's hashes stay home too."""
    sizes = []
    for prompt_len in (8, 4000):
        seq = Sequence(range(prompt_len), 16)
        manager = BlockManager(300, 16)
        manager.allocate(seq)                # hashes the prompt's full blocks
        seq.append_token(1)
        sizes.append(len(pickle.dumps(seq)))
        manager.free(seq)
    assert sizes[1] - sizes[0] < 100
