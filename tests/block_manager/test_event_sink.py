"""The one event sink: eviction reports what it drops, and the teaching log and the KV events are two
consumers of the same reports."""

from array import array

from kvlab import BlockManager, Sequence
from kvlab.blocks.block_pool import BlockPool
from kvlab.blocks.events import EventLog, EventSink, Fanout, make_sink
from kvlab.blocks.eviction import LRUPolicy
from kvlab.blocks.events import event_dict


class EvictionRecorder(EventSink):
    """A second tier in miniature: keeps every evicted block's record."""

    def __init__(self):
        self.records = []

    def evicted(self, blocks, hashes, contents):
        self.records.extend(zip(blocks, hashes, contents))


def test_reusing_a_cached_block_reports_its_block_hash_and_bytes():
    tier = EvictionRecorder()
    pool = BlockPool(3, LRUPolicy(), 0, tier)
    with pool.transaction() as txn:
        first = txn.pop(2)
    pool.fill(first, [11, 22], [b"tokens 1", b"tokens 2"])   # both sealed and cached
    pool.release(first[::-1])                                 # free but warm
    with pool.transaction() as txn:
        reused = txn.pop(3)                                   # the never-used block, then both warm ones
    pool.fill(reused, [33], [b"tokens 3"])
    assert tier.records == [(first[1], 22, b"tokens 2"), (first[0], 11, b"tokens 1")]
    assert pool.evictions == 2 and not pool.index.is_cached(first[0]) and pool.index.block_hash(reused[0]) == 33


def test_a_manager_reports_evicted_prompt_blocks_with_their_tokens():
    tier = EvictionRecorder()
    m = BlockManager(2, block_size=2)
    m._pool.sink = tier                       # no public hook yet: a second tier is future work
    old = Sequence([1, 2, 3, 4], 2)
    m.allocate(old)
    m.free(old)
    m.allocate(Sequence([7, 7, 7], 2))        # reuses both cached blocks
    assert len(tier.records) == 2 and None not in {block_hash for _, block_hash, _ in tier.records}
    assert sorted(content for _, _, content in tier.records) == [array("q", [1, 2]).tobytes(),
                                                                 array("q", [3, 4]).tobytes()]


def test_make_sink_holds_only_the_consumers_that_are_on():
    log, other = EventLog(), EventLog()
    assert make_sink(None, None) is None and make_sink(None, log) is log
    both = make_sink(log, other)
    assert isinstance(both, Fanout) and both.consumers == (log, other)
    both.freed(7)
    assert log.events == other.events == [("free", 7, None, None)]
    assert BlockManager(4)._sink is None      # nothing listens: every report site is one `is None` check


def _workload(m):
    """Every kind of teaching event: miss, seal, allocate, fork, cow, append, release, swap_out, swap_in,
    free, hit, evict; returns the sequences' ids in order of creation."""
    a = Sequence([1, 2, 3], 2)
    m.allocate(a)                      # blocks 0 (sealed), 1
    b = Sequence([])
    m.fork(a, b)
    b.append_token(4)
    m.append_slots(b)                  # b writes the shared partial block: copy-on-write, then seals its copy
    a.append_token(5)
    a.append_token(6)
    m.append_slots(a)                  # a fills block 1 and gets a new one
    m.swap_out(b)
    m.swap_in(b)
    m.free(a)
    m.free(b)
    c = Sequence([1, 2] + [9] * 9, 2)  # hits block 0, then needs every other block: evicts the cached ones
    m.allocate(c)
    m.free(c)
    m.reset_prefix_cache()
    return a.seq_id, b.seq_id, c.seq_id


def _named(events, seq_ids) -> list:
    """The log with each sequence named a, b, c in order of creation (ids differ from run to run)."""
    names = dict(zip(seq_ids, "abc"))
    return [(e.kind, names.get(e.seq_id), e.block_id, names.get(e.other, e.other)) for e in events]


def test_the_teaching_log_is_as_it_always_was():
    m = BlockManager(6, block_size=2, num_cpu_blocks=4, record_events=True)
    assert _named(m.events, _workload(m)) == [
        ("miss", "a", 0, None), ("miss", "a", 1, None), ("seal", None, 0, None), ("allocate", "a", None, None),
        ("fork", "b", None, "a"),
        ("cow", "b", 2, 1), ("seal", None, 2, None),
        ("append", "a", 3, None), ("seal", None, 1, None),
        ("release", None, 2, None), ("swap_out", "b", 0, 0), ("swap_out", "b", 2, 1),
        ("swap_in", "b", 4, 1),
        ("release", None, 3, None), ("release", None, 1, None), ("free", "a", None, None),
        ("release", None, 4, None), ("release", None, 0, None), ("free", "b", None, None),
        ("hit", "c", 0, None), ("miss", "c", 5, None), ("miss", "c", 3, None), ("miss", "c", 4, None),
        ("miss", "c", 2, None), ("miss", "c", 1, None),
        ("evict", None, 2, None), ("evict", None, 1, None),
        ("seal", None, 5, None), ("seal", None, 3, None), ("seal", None, 4, None), ("seal", None, 2, None),
        ("allocate", "c", None, None),
        ("release", None, 1, None), ("release", None, 2, None), ("release", None, 4, None),
        ("release", None, 3, None), ("release", None, 5, None), ("release", None, 0, None),
        ("free", "c", None, None)]


def test_both_consumers_on_see_what_each_sees_alone():
    def run(record_events, kv_events):
        m = BlockManager(6, block_size=2, num_cpu_blocks=4, record_events=record_events, kv_events=kv_events)
        kv = []
        if kv_events:
            m.kv_events.subscribe(lambda event: kv.append(event_dict(event)))
        seq_ids = _workload(m)
        return _named(m.events, seq_ids) if record_events else None, kv

    log, _ = run(True, False)
    _, kv = run(False, True)
    assert run(True, True) == (log, kv)
    assert {e["type"] for e in kv} == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
