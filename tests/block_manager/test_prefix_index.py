"""The prefix index on its own (kvlab.blocks.prefix_cache): verified lookup, seal, and eviction as a value, with
content ids shared across the indexes of two tiers."""

import pytest

from kvlab.blocks.prefix_cache import ROOT, ContentIds, Evicted, PrefixIndex
from kvlab.errors import InvariantViolation


def test_lookup_verifies_bytes_and_parent_not_only_hashes():
    index = PrefixIndex(4)
    last = index.seal([2, 0], [11, 22], [b"a", b"b"], ROOT)
    assert index.lookup([11, 22], [b"a", b"b"], 5) == [2, 0]
    assert index.lookup([11, 22], [b"a", b"X"], 5) == [2]          # same hash, other bytes: a miss
    assert index.lookup([22], [b"b"], 5) == []                       # right bytes after the wrong parent
    assert index.lookup([22], [b"b"], 5, parent=index.content_id(2)) == [0]
    assert last == index.content_id(0) and index.lookup([11, 22], [b"a", b"b"], 1) == [2]


def test_evict_returns_what_it_dropped_and_only_cached_slots():
    index = PrefixIndex(4)
    index.seal([1, 3], [11, 22], [b"a", b"b"], ROOT)
    ids = index.content_id(1), index.content_id(3)
    assert index.evict([0, 2]) is None
    evicted = index.evict([3, 0, 1])
    assert evicted == Evicted([3, 1], [22, 11], [b"b", b"a"], [ids[1], ids[0]], [ids[0], ROOT])
    assert not index.cached and not index.is_cached(1) and index.lookup([11], [b"a"], 1) == []
    index.check()


def test_two_tiers_share_content_ids_so_one_id_means_one_prefix_everywhere():
    ids = ContentIds()
    gpu, cpu = PrefixIndex(2, ids), PrefixIndex(3, ids, name="CPU slot")
    gpu.seal([0], [11], [b"a"], ROOT)
    cpu.seal([2], [11], [b"other"], ROOT)
    assert cpu.content_id(2) == gpu.content_id(0) + 1


def test_each_kv_cache_group_is_a_namespace_of_the_index():
    index = PrefixIndex(6, num_groups=2)
    index.seal([1, 2], [11, 22], [b"a", b"b"], ROOT, group=0)
    assert index.lookup([11, 22], [b"a", b"b"], 5, group=1) == []  # the same bytes: another group's layers
    index.seal([4], [11], [b"a"], ROOT, group=1)                     # the same hash, cached once per group
    assert index.lookup([11], [b"a"], 5, group=0) == [1] and index.lookup([11], [b"a"], 5, group=1) == [4]
    assert index.num_cached == 3 and index.is_cached(4) and index.content_id(4) != index.content_id(1)
    index.check()
    assert index.evict([4]).slots == [4]                             # group 1's entry goes, group 0's stays
    assert index.lookup([11], [b"a"], 5, group=0) == [1] and index.lookup([11], [b"a"], 5, group=1) == []
    index.check()


def test_check_finds_a_slot_cached_under_another_groups_namespace():
    index = PrefixIndex(4, num_groups=2)
    index.seal([1], [11], [b"a"], ROOT, group=1)
    index.group[1] = 0                                               # misfiled: its entry is in group 1's map
    with pytest.raises(InvariantViolation, match="group 1"):
        index.check()
