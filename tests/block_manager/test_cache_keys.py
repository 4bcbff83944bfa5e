"""Cache salts, adapter keys and per-block extra keys: equal tokens share a block only where the keys agree."""

import pickle

import hypothesis.strategies as st
import pytest
from helpers import grow
from hypothesis import given

from kvlab import AllocStatus, BlockManager, InvalidArgumentError, Sequence
from kvlab.blocks.sequence import encode_key

CONSTANT_HASH = dict(hash_fn=lambda parent, tokens: 7)  # every block collides: only the verification separates


def allocated(manager, tokens, **keys):
    seq = Sequence(tokens, manager.block_size, **keys)
    manager.allocate(seq)
    return seq


@pytest.mark.parametrize("hashing", [{}, CONSTANT_HASH], ids=["xxh64", "constant-hash"])
def test_different_salts_never_share_and_the_same_salt_shares(hashing):
    manager = BlockManager(32, block_size=4, **hashing)
    a = allocated(manager, range(5), cache_salt="tenant-a")
    b = allocated(manager, range(5), cache_salt="tenant-b")
    plain = allocated(manager, range(5))
    as_bytes = allocated(manager, range(5), cache_salt=b"tenant-a")   # a str and a bytes salt never meet
    assert b.num_cached_tokens == plain.num_cached_tokens == as_bytes.num_cached_tokens == 0
    assert len({a.block_table[0], b.block_table[0], plain.block_table[0], as_bytes.block_table[0]}) == 4
    again = allocated(manager, range(5), cache_salt="tenant-a")
    assert again.num_cached_tokens == 4 and again.block_table[0] == a.block_table[0]
    # A hash blind to salts (hash_fn sees only tokens) keeps tenants apart but lets a's block shadow the plain
    # one under their common hash: the plain prompt misses its own block (see kvlab.blocks.prefix_cache).
    assert (allocated(manager, range(5)).block_table[0] == plain.block_table[0]) == (not hashing)
    manager.check_invariants()


def test_salted_blocks_hash_differently_so_a_probe_misses_at_the_hash_map():
    manager = BlockManager(8, block_size=4)
    a, b = allocated(manager, range(9), cache_salt="a"), allocated(manager, range(9))
    assert manager.block_hash(a.block_table[0]) != manager.block_hash(b.block_table[0])
    # Chaining carries the salt: block 1 (no key of its own) differs too.
    assert manager.block_hash(a.block_table[1]) != manager.block_hash(b.block_table[1])


def test_queries_honour_the_salt():
    manager = BlockManager(4, block_size=4)
    allocated(manager, range(9), cache_salt="a")    # 3 blocks; 1 is free
    same, other = Sequence(range(9), 4, cache_salt="a"), Sequence(range(9), 4, cache_salt="b")
    # Asked alternately on equal tokens: the last prompt's remembered hashes must not answer for the other salt.
    for _ in range(2):
        assert manager.get_num_cached_tokens(same) == 8 and manager.get_num_cached_tokens(other) == 0
        assert manager.can_allocate(same) is AllocStatus.OK and manager.can_allocate(other) is AllocStatus.LATER


@pytest.mark.parametrize("hashing", [{}, CONSTANT_HASH], ids=["xxh64", "constant-hash"])
def test_extra_keys_differing_in_one_block_share_only_the_blocks_before_it(hashing):
    manager = BlockManager(64, block_size=2, **hashing)
    tokens = [1, 2, 1, 2, 1, 2, 1, 2, 5]             # equal blocks: only keys and parents tell them apart
    a = allocated(manager, tokens, extra_keys={2: "image-1"})
    b = allocated(manager, tokens, extra_keys={2: "image-2"})
    c = allocated(manager, tokens, extra_keys={2: "image-1"})
    d = allocated(manager, tokens)
    # A constant hash registers one block (a's block 0) under its one hash, so no hit gets past block 0.
    expected = dict(b=2, c=4, d=2) if not hashing else dict(b=1, c=1, d=1)
    for name, seq in dict(b=b, c=c, d=d).items():
        hits = expected[name]
        assert seq.num_cached_tokens == 2 * hits and seq.block_table[:hits] == a.block_table[:hits], name
    assert set(b.block_table[2:]).isdisjoint(a.block_table)
    assert set(d.block_table[2:]).isdisjoint(a.block_table + b.block_table)
    manager.check_invariants()


def test_adapter_key_separates_the_whole_sequence_and_no_field_collides_with_another():
    manager = BlockManager(64, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    sql = allocated(manager, tokens, adapter_key="sql")
    assert allocated(manager, tokens, adapter_key="sql").num_cached_tokens == 6
    # The same value as a salt, an adapter or block 0's key, or no key at all: four different sequences.
    for keys in ({"adapter_key": "chat"}, {"cache_salt": "sql"}, {"extra_keys": {0: "sql"}}, {}):
        other = allocated(manager, tokens, **keys)
        assert other.num_cached_tokens == 0 and set(other.block_table).isdisjoint(sql.block_table)
    tenant_sql = allocated(manager, tokens, cache_salt="t", adapter_key="sql", extra_keys={2: 9})
    assert allocated(manager, tokens, cache_salt="t", adapter_key="sql").num_cached_tokens == 4
    again = allocated(manager, tokens, cache_salt="t", adapter_key="sql", extra_keys={2: 9})
    assert again.block_table[:3] == tenant_sql.block_table[:3]


def test_empty_extra_keys_are_no_keys():
    manager = BlockManager(8, block_size=2)
    a = allocated(manager, [1, 2, 3])
    assert allocated(manager, [1, 2, 3], extra_keys={}).block_table[0] == a.block_table[0]


def test_decode_blocks_sealed_by_append_slots_get_their_keys():
    manager = BlockManager(32, block_size=2)
    a = allocated(manager, [1, 2, 3], cache_salt="a", extra_keys={2: "image"})
    grow(manager, a, [4, 5, 6, 7, 8])               # seals blocks 1, 2 (keyed) and 3
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    same = allocated(manager, tokens, cache_salt="a", extra_keys={2: "image"})
    assert same.num_cached_tokens == 8 and same.block_table[:4] == a.block_table[:4]
    assert allocated(manager, tokens, cache_salt="a", extra_keys={2: "other"}).num_cached_tokens == 4
    assert allocated(manager, tokens, cache_salt="a").num_cached_tokens == 4
    assert allocated(manager, tokens).num_cached_tokens == 0
    manager.check_invariants()


def test_fork_gives_the_child_the_parents_salt_and_keys():
    manager = BlockManager(32, block_size=2)
    parent = allocated(manager, [1, 2, 3], cache_salt="a", adapter_key=3, extra_keys={2: "image"})
    child = Sequence([], 2, cache_salt="replaced")
    manager.fork(parent, child)
    assert (child.cache_salt, child.adapter_key, dict(child.extra_keys)) == ("a", 3, {2: "image"})
    grow(manager, child, [4, 5, 6])                 # the child seals blocks 1 and 2 (keyed)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hit = allocated(manager, tokens, cache_salt="a", adapter_key=3, extra_keys={2: "image"})
    assert hit.block_table[:3] == child.block_table[:3]
    assert allocated(manager, tokens, cache_salt="a", adapter_key=3).num_cached_tokens == 4


def test_pickled_sequences_keep_salt_and_keys():
    seq = Sequence(range(9), 4, cache_salt=b"a", adapter_key=("lora", 7), extra_keys={1: "image"})
    waiting = pickle.loads(pickle.dumps(seq))
    seq.append_token(9)
    decoding = pickle.loads(pickle.dumps(seq))
    for copy in (waiting, decoding):
        assert (copy.cache_salt, copy.adapter_key, dict(copy.extra_keys)) == (b"a", ("lora", 7), {1: "image"})
    manager = BlockManager(16, block_size=4)
    original = allocated(manager, range(9), cache_salt=b"a", adapter_key=("lora", 7), extra_keys={1: "image"})
    manager.allocate(waiting)                       # keys that travel must still select the same blocks
    assert waiting.block_table[:2] == original.block_table[:2]


def test_salt_and_keys_are_read_only():
    seq = Sequence([1, 2], cache_salt="a", extra_keys={0: "x"})
    with pytest.raises(TypeError):
        seq.extra_keys[0] = "y"
    with pytest.raises(AttributeError):
        seq.cache_salt = "b"
    assert seq.cache_salt == "a" and dict(seq.extra_keys) == {0: "x"}


@pytest.mark.parametrize("keys, message", [
    (dict(cache_salt=""), "cache_salt must be None or a non-empty str or bytes"),
    (dict(cache_salt=b""), "cache_salt must be None or a non-empty str or bytes"),
    (dict(cache_salt=1), "cache_salt must be None or a non-empty str or bytes"),
    (dict(cache_salt=["a"]), "cache_salt must be None or a non-empty str or bytes"),
    (dict(adapter_key=1.5), "adapter_key must be a str, bytes, int, or a tuple of those"),
    (dict(adapter_key=True), "adapter_key must be a str, bytes, int"),
    (dict(adapter_key=["a"]), "adapter_key must be a str, bytes, int"),
    (dict(extra_keys=[(0, "a")]), r"extra_keys must be None or a mapping \{block index: key\}"),
    (dict(extra_keys={-1: "a"}), "extra_keys block index must be an int"),
    (dict(extra_keys={"0": "a"}), "extra_keys block index must be an int"),
    (dict(extra_keys={True: "a"}), "extra_keys block index must be an int"),
    (dict(extra_keys={2**40: "a"}), "extra_keys block index must be an int"),
    (dict(extra_keys={0: None}), r"extra_keys\[0\] must be a str, bytes, int"),
    (dict(extra_keys={1: ("a", 2.0)}), r"extra_keys\[1\] must be a str, bytes, int"),
    (dict(extra_keys={0: bytearray(b"a")}), r"extra_keys\[0\] must be a str, bytes, int"),
    (dict(extra_keys={0: ((((((((("deep",),),),),),),),),)}), "nested too deep"),
])
def test_bad_salt_or_keys_are_refused_saying_what_is_allowed(keys, message):
    before = Sequence([1]).seq_id
    with pytest.raises(InvalidArgumentError, match=message):
        Sequence([1, 2, 3], 2, **keys)
    assert Sequence([1]).seq_id == before + 1      # the refused sequence took no id


keys = st.recursive(st.integers() | st.text() | st.binary(), lambda inner: st.lists(inner, max_size=3).map(tuple),
                    max_leaves=6)


@given(keys, keys)
def test_distinct_keys_never_encode_equal(a, b):
    assert (encode_key(a) == encode_key(b)) == (a == b)


block_keys = st.sampled_from([None, "image-1", ("image-2", 3)])


@given(salts=st.lists(st.sampled_from([None, "a", b"a", "b"]), min_size=2, max_size=2),
       adapters=st.lists(st.sampled_from([None, 1, "1"]), min_size=2, max_size=2),
       extras=st.lists(st.lists(block_keys, min_size=4, max_size=4), min_size=2, max_size=2))
def test_equal_tokens_share_exactly_the_blocks_whose_keys_agree_up_to_them(salts, adapters, extras):
    """The second of two sequences with equal tokens hits the first's blocks up to the first block whose
    identity differs: block 0 carries the salt and the adapter, and every block its own extra key."""
    def sequence(k):
        extra_keys = {i: key for i, key in enumerate(extras[k]) if key is not None}
        return Sequence([1] * 9, 2, cache_salt=salts[k], adapter_key=adapters[k], extra_keys=extra_keys)

    agree = 0 if (salts[0], adapters[0]) != (salts[1], adapters[1]) else next(
        (i for i in range(4) if extras[0][i] != extras[1][i]), 4)
    # A constant hash registers one block (the first's block 0) under its one hash: no hit gets past block 0.
    for hashing, hits in (({}, agree), (CONSTANT_HASH, min(agree, 1))):
        manager = BlockManager(16, block_size=2, **hashing)
        first, second = sequence(0), sequence(1)
        manager.allocate(first)
        manager.allocate(second)
        assert second.num_cached_tokens == 2 * hits and second.block_table[:hits] == first.block_table[:hits]
        manager.check_invariants()
