"""kvlab.viz draws a HybridBlockManager: its one pool as a BlockManager's, its tables one row per (sequence,
group), labelled with the group, where a window's released entries show as null (also while swapped out,
where CPU block 0 is a real block).

Expectations come from the scenario (which group released which entries, by the window arithmetic) and from
the manager's queries, not from kvlab.viz's own classification."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from kvlab import BlockManager, InvalidArgumentError, Sequence  # noqa: E402
from kvlab.blocks.manager import HybridBlockManager  # noqa: E402
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from kvlab.viz import draw_block_tables, draw_pool, snapshot  # noqa: E402
from kvlab.viz.snapshot import (CPU_COLOR, FREE, NULL, SHARED, STATE_COLORS, USED, WARM,  # noqa: E402
                                group_labels)

BS, WINDOW = 4, 8


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def grow(m, seq, tokens):
    for t in tokens:  # one decode step per token
        seq.append_token(t)
        m.append_slots(seq)


def scenario():
    """A full and a window-8 group. A: 10 prompt tokens and 10 decoded; its last query (19) sees 12..19, so
    the window group released blocks 0..2. B: A's prompt (the full group hits A's two full blocks). C: 13
    tokens and 9 decoded (last query 21 sees 14..21: blocks 0..2 released), then swapped out."""
    m = HybridBlockManager(24, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(WINDOW)], num_cpu_blocks=16)
    a, b, c = Sequence(range(10), BS), Sequence(range(10), BS), Sequence(range(100, 113), BS)
    m.allocate(a)
    grow(m, a, range(10, 20))
    m.allocate(b)
    m.allocate(c)
    grow(m, c, range(13, 22))
    m.swap_out(c)
    return m, (a, b, c)


def patches_by_gid(ax) -> dict:
    return {p.get_gid(): p for p in ax.patches if p.get_gid()}


def texts_by_gid(ax) -> dict:
    return {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}


def test_a_hybrid_snapshot_has_a_labelled_table_per_sequence_and_group():
    m, (a, b, c) = scenario()
    view = snapshot(m, [a, b, c], names=["A", "B", "C"])
    assert [(t.seq_id, t.group, t.display_name) for t in view.tables] == [
        (a.seq_id, 0, "A · full"), (a.seq_id, 1, "A · window 8"), (b.seq_id, 0, "B · full"),
        (b.seq_id, 1, "B · window 8"), (c.seq_id, 0, "C · full"), (c.seq_id, 1, "C · window 8")]
    assert [t.blocks for t in view.tables] == [tuple(table) for s in (a, b, c) for table in m.block_tables(s)]
    assert [t.num_released for t in view.tables] == [0, 3, 0, 0, 0, 3]  # B's first query (0) sees everything
    assert [t.on_cpu for t in view.tables] == [False] * 4 + [True] * 2
    assert [len(t.blocks) for t in view.tables] == [5, 5, 3, 3, 6, 6]
    unnamed = snapshot(m, [a]).tables
    assert [t.display_name for t in unnamed] == [f"seq {a.seq_id} · full", f"seq {a.seq_id} · window 8"]
    # a sequence this manager does not hold (waiting, or freed) shows an empty table in each group
    m.free(b)
    assert [(t.group, t.blocks) for t in snapshot(m, [Sequence(range(5), BS), b]).tables] == [(0, ()), (1, ())] * 2
    # a BlockManager's tables stay unlabelled, one per sequence
    single = BlockManager(8, BS)
    d = Sequence(range(5), BS)
    single.allocate(d)
    assert [(t.group, t.display_name) for t in snapshot(single, [d]).tables] == [(None, f"seq {d.seq_id}")]


def test_group_labels_tell_alike_groups_apart():
    assert group_labels([FullAttentionSpec(), SlidingWindowSpec(8)]) == ["full", "window 8"]
    assert group_labels([SlidingWindowSpec(4), FullAttentionSpec(), SlidingWindowSpec(4)]) == [
        "window 4 (group 0)", "full", "window 4 (group 2)"]


def test_a_hybrid_pool_agrees_with_the_managers_queries():
    m, (a, b, c) = scenario()
    view = snapshot(m, [a, b, c])
    refs = [m.ref_count(block) for block in range(m.num_blocks)]
    assert view.refs.tolist() == refs
    assert view.cached.tolist() == [m.is_cached(block) for block in range(m.num_blocks)]
    assert [int(view.reuse_rank[block]) for block in m.free_block_ids()] == list(range(m.num_free_blocks))
    assert view.states[0] == NULL  # the window group's released entries point at it
    # A's two full prompt blocks are B's too (the full group's hit); every other GPU entry is one table's.
    shared = set(m.block_tables(a)[0][:2])
    assert shared == set(m.block_tables(b)[0][:2]) and {block for block in shared if refs[block] == 2} == shared
    held = [block for s in (a, b) for table, released in zip(m.block_tables(s), m.num_released_blocks_per_group(s))
            for block in table[released:]]
    assert {block for block in range(m.num_blocks) if view.states[block] == SHARED} == shared
    assert {block for block in range(m.num_blocks) if view.states[block] == USED} == set(held) - shared
    assert view.count(WARM) + view.count(FREE) == m.num_free_blocks
    # C's CPU blocks: every entry of both its tables but the window group's 3 released ones
    full, window = m.block_tables(c)
    assert set(view.cpu_refs) == set(full) | set(window[3:]) and view.num_free_cpu_blocks == m.num_free_cpu_blocks
    boxes, texts = patches_by_gid(draw_pool(view)), texts_by_gid(draw_pool(m))
    assert boxes["pool-0"].get_facecolor() == to_rgba(STATE_COLORS[NULL]) and texts["pool-sub-0"] == "null"
    assert all(boxes[f"pool-{block}"].get_facecolor() == to_rgba(STATE_COLORS[SHARED]) for block in shared)


def test_released_entries_draw_as_null_also_where_a_swapped_table_holds_cpu_block_0():
    m, (a, b, c) = scenario()
    full, window = m.block_tables(c)
    assert full[0] == 0 and window[:3] == [0, 0, 0]  # the premise: CPU block 0 and null entries both read 0
    ax = draw_block_tables(m, [a, b, c], names=["A", "B", "C"])
    patches, texts = patches_by_gid(ax), texts_by_gid(ax)
    for seq in (a, c):  # the window group's released entries: null, no arrow
        for i in range(3):
            assert texts[f"table-label-{seq.seq_id}g1-{i}"] == "∅"
            assert patches[f"fill-{seq.seq_id}g1-{i}"].get_facecolor() == to_rgba(STATE_COLORS[NULL])
            assert f"arrow-{seq.seq_id}g1-{i}" not in texts
    assert [texts[f"table-label-{c.seq_id}g0-{i}"] for i in range(len(full))] == [f"c{block}" for block in full]
    assert [texts[f"table-label-{c.seq_id}g1-{i}"] for i in range(3, 6)] == [f"c{block}" for block in window[3:]]
    assert patches[f"fill-{c.seq_id}g0-0"].get_facecolor() == to_rgba(CPU_COLOR)
    arrows = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    arrow_end, cpu_0 = arrows[f"arrow-{c.seq_id}g0-0"].xy, patches["cpu-0"]  # up to CPU block 0
    assert cpu_0.get_x() < arrow_end[0] < cpu_0.get_x() + cpu_0.get_width()
    assert [texts[f"table-label-{b.seq_id}g{g}-{i}"] for g in (0, 1) for i in range(3)] == [
        str(block) for table in m.block_tables(b) for block in table]
    # each group's row is labelled with it, in its sequence's colour
    rows = {t.get_text().split("\n")[0]: t.get_color() for t in ax.texts if "\n" in t.get_text()}
    assert rows["A · full"] == rows["A · window 8"] != rows["B · full"] == rows["B · window 8"]


def test_a_bad_argument_names_the_managers_allowed():
    m, seqs = scenario()
    allowed = r"BlockManager \(or a HybridBlockManager, or the engine's KVCacheManager\), got"
    for draw in (snapshot, draw_pool, draw_block_tables):
        with pytest.raises(InvalidArgumentError, match=f"{allowed} str"):
            draw("not a manager")
    with pytest.raises(InvalidArgumentError, match="Sequence"):
        draw_block_tables(m, [1, 2])
    with pytest.raises(InvalidArgumentError, match="snapshot"):
        draw_block_tables(snapshot(m, seqs), seqs)


def test_groups_of_different_block_sizes_fill_their_blocks_by_their_own_size():
    """A 12-token block and a 4-token block of a 10-token prompt: the full group's one block is 10/12 full, the
    window group's last block 2/4; the labels name each group's block size."""
    m = HybridBlockManager(16, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(WINDOW)],
                           group_block_sizes=[3 * BS, BS])
    seq = Sequence(range(10), BS)
    m.allocate(seq)
    view = snapshot(m, [seq], names=["A"])
    assert [(t.display_name, t.block_size) for t in view.tables] == [
        ("A · full, 12-token blocks", 12), ("A · window 8, 4-token blocks", 4)]
    fills = {gid: p.get_width() for gid, p in patches_by_gid(draw_block_tables(view)).items()
             if gid.startswith("fill-")}
    full, window = fills[f"fill-{seq.seq_id}g0-0"], fills[f"fill-{seq.seq_id}g1-2"]
    assert full == pytest.approx(10 / 12 * fills[f"fill-{seq.seq_id}g1-0"]) and window == pytest.approx(full * 0.6)
