"""kvlab.viz pool and block-table drawings: they draw on edge cases, and what they draw matches the manager.

Expectations are derived from the scenario (which sequence holds which block), not from kvlab.viz's own
state classification, so a wrong colour, count or label fails."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402

from kvlab import BlockManager, InvalidArgumentError, Sequence  # noqa: E402
from kvlab.viz import draw_block_tables, draw_pool, snapshot  # noqa: E402
from kvlab.viz.snapshot import CPU_COLOR, FREE, NULL, SHARED, STATE_COLORS, USED, WARM  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def patches_by_gid(ax) -> dict:
    return {p.get_gid(): p for p in ax.patches if p.get_gid()}


def texts_by_gid(ax) -> dict:
    return {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}


def legend_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def seeds_scenario():
    """Block size 4. A = 1..8 and B = 1..10 share A's two blocks; C = 0,2..10 shares none and is freed:
    its two full blocks stay cached (warm), its partial block is plain free."""
    m = BlockManager(12, 4)
    a, b, c = Sequence(range(1, 9), 4), Sequence(range(1, 11), 4), Sequence([0, *range(2, 11)], 4)
    for s in (a, b, c):
        m.allocate(s)
    c_blocks = list(c.block_table)
    m.free(c)
    return m, (a, b, c), c_blocks


def test_pool_boxes_are_coloured_by_state_with_ref_counts_and_reuse_order():
    m, (a, b, _), c_blocks = seeds_scenario()
    expected = {blk: FREE for blk in range(m.num_blocks)}
    expected.update({blk: SHARED for blk in a.block_table})
    expected[b.block_table[2]] = USED
    expected.update({blk: WARM for blk in c_blocks[:2]})
    ax = draw_pool(m)
    boxes, texts = patches_by_gid(ax), texts_by_gid(ax)
    for blk, state in expected.items():
        assert boxes[f"pool-{blk}"].get_facecolor() == to_rgba(STATE_COLORS[state]), blk
        assert texts[f"pool-id-{blk}"] == str(blk)
    for blk in a.block_table:
        assert texts[f"pool-sub-{blk}"] == "ref 2"
    assert texts[f"pool-sub-{b.block_table[2]}"] == "ref 1"
    for rank, blk in enumerate(m.free_block_ids()):
        assert texts[f"pool-sub-{blk}"] == f"#{rank}"
    # The cached marker sits exactly on the hittable blocks: A's two (in use) and C's two (warm).
    dots = {int(g.split("-")[1]) for g in boxes if g.startswith("cached-")}
    assert dots == set(a.block_table) | set(c_blocks[:2])
    assert "shared (ref > 1): 2" in legend_labels(ax)
    assert "warm (free, cached): 2" in legend_labels(ax)
    assert f"free: {m.num_blocks - 5}" in legend_labels(ax)


def test_empty_pool_without_sequences():
    m = BlockManager(5, 4)
    ax = draw_pool(m)
    boxes = patches_by_gid(ax)
    assert all(boxes[f"pool-{b}"].get_facecolor() == to_rgba(STATE_COLORS[FREE]) for b in range(5))
    assert "free: 5" in legend_labels(ax)
    ax = draw_block_tables(m, [])
    gids = patches_by_gid(ax)
    assert sorted(g for g in gids if g.startswith("pool-")) == sorted(f"pool-{b}" for b in range(5))
    assert not [g for g in gids if g.startswith("table-")]
    assert not [g for g in texts_by_gid(ax) if g.startswith("arrow-")]


def test_every_block_shared():
    m = BlockManager(3, 4)
    parent = Sequence(range(12), 4)
    m.allocate(parent)
    children = [Sequence([], 4) for _ in range(2)]
    for child in children:
        m.fork(parent, child)
    ax = draw_pool(m)
    boxes, texts = patches_by_gid(ax), texts_by_gid(ax)
    for blk in range(3):
        assert boxes[f"pool-{blk}"].get_facecolor() == to_rgba(STATE_COLORS[SHARED])
        assert texts[f"pool-sub-{blk}"] == "ref 3"
    assert "shared (ref > 1): 3" in legend_labels(ax)
    ax = draw_block_tables(m, [parent, *children])
    arrows = [g for g in texts_by_gid(ax) if g.startswith("arrow-")]
    assert len(arrows) == 9  # three tables of three entries, each pointing into the pool


def test_block_tables_label_cells_with_physical_ids_and_fill_partial_blocks():
    m = BlockManager(10, 4)
    seq = Sequence(range(7), 4)  # 7 tokens: one full block, one with 3 of 4 slots
    m.allocate(seq)
    seq.append_token(99)
    m.append_slots(seq)
    seq.append_token(100)  # a new block with 1 token
    m.append_slots(seq)
    ax = draw_block_tables(m, [seq])
    texts, patches = texts_by_gid(ax), patches_by_gid(ax)
    arrows = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    assert [texts[f"table-label-{seq.seq_id}-{i}"] for i in range(3)] == [str(b) for b in seq.block_table]
    full_width = patches[f"fill-{seq.seq_id}-0"].get_width()
    assert patches[f"fill-{seq.seq_id}-1"].get_width() == pytest.approx(full_width)
    assert patches[f"fill-{seq.seq_id}-2"].get_width() == pytest.approx(full_width / 4)
    for i, blk in enumerate(seq.block_table):  # each arrow ends over its physical block
        arrow_end = arrows[f"arrow-{seq.seq_id}-{i}"].xy
        box = patches[f"pool-{blk}"]
        assert box.get_x() < arrow_end[0] < box.get_x() + box.get_width()


def test_ten_thousand_blocks_are_aggregated():
    m = BlockManager(10_000, 16)
    rng = np.random.default_rng(7)
    seqs = [Sequence(rng.integers(0, 2**20, size=int(n)), 16) for n in rng.integers(50, 4000, size=40)]
    for s in seqs:
        m.allocate(s)
    for s in seqs[::3]:
        m.free(s)
    ax = draw_pool(m)
    images = [im for im in ax.get_images() if isinstance(im, AxesImage)]
    assert len(images) == 1 and len(ax.patches) < 10  # one heatmap, not 10k boxes
    drawn = images[0].get_array().compressed()
    used = sum(len(s.block_table) for s in seqs if s.block_table)
    assert drawn.size == 10_000
    assert np.count_nonzero(drawn == USED) == used
    assert f"used: {used}" in legend_labels(ax)
    assert np.count_nonzero((drawn == FREE) | (drawn == WARM)) == m.num_free_blocks
    assert (drawn[list(seqs[1].block_table)] == USED).all()  # each pixel sits at its block id
    assert (drawn[m.free_block_ids()] != USED).all()
    tables_ax = draw_block_tables(m, seqs[1:4])  # long tables: compact rows, one cell per logical block
    grid = tables_ax.get_images()[0].get_array()
    assert grid.shape[0] == 3 and grid.count() == sum(len(s.block_table) for s in seqs[1:4])


def test_swapped_sequences_point_into_the_cpu_pool():
    m = BlockManager(8, 4, num_cpu_blocks=6)
    parent = Sequence(range(10), 4)
    m.allocate(parent)
    child = Sequence([], 4)
    m.fork(parent, child)
    m.swap_out(parent)
    ax = draw_block_tables(m, [parent, child])
    patches, texts = patches_by_gid(ax), texts_by_gid(ax)
    cpu = {int(g.split("-")[1]) for g in patches if g.startswith("cpu-")}
    assert cpu == set(parent.block_table)
    assert all(patches[f"cpu-{c}"].get_facecolor() == to_rgba(CPU_COLOR) for c in cpu)
    assert [texts[f"table-label-{parent.seq_id}-{i}"] for i in range(3)] == [f"c{c}" for c in parent.block_table]
    assert [texts[f"table-label-{child.seq_id}-{i}"] for i in range(3)] == [str(b) for b in child.block_table]
    assert any(t.get_text() == f"CPU pool\n({m.num_free_cpu_blocks} free)" for t in ax.texts)
    # an engine on a CPU names its pools for where they are
    ax = draw_block_tables(m, [parent, child], pool_label="KV pool (CPU)", swap_label="swap pool (host)")
    labels = {t.get_text() for t in ax.texts}
    assert "KV pool (CPU)" in labels and f"swap pool (host)\n({m.num_free_cpu_blocks} free)" in labels
    assert not any(label.startswith(("GPU pool", "CPU pool")) for label in labels)
    with pytest.raises(InvalidArgumentError, match="pool_label must be a str"):
        draw_block_tables(m, [parent, child], pool_label=None)
    draw_pool(m)  # the GPU side alone draws too


def window_step(m, prompt_len, total_len):
    """A prompt, then one step that appends the rest: the window releases blocks at the step's start."""
    seq = Sequence(range(prompt_len), m.block_size)
    m.allocate(seq)
    for t in range(prompt_len, total_len):
        seq.append_token(t)
    m.append_slots(seq)
    return seq


def test_sliding_window_null_block():
    m = BlockManager(8, 4, sliding_window=6)
    seq = window_step(m, 9, 13)  # the step's queries start at 9 and see 4..: logical block 0 is released
    ax = draw_pool(m)
    patches, texts = patches_by_gid(ax), texts_by_gid(ax)
    assert patches["pool-0"].get_facecolor() == to_rgba(STATE_COLORS[NULL])
    assert texts["pool-sub-0"] == "null"
    assert "null (sliding window): 1" in legend_labels(ax)
    ax = draw_block_tables(m, [seq])
    patches, texts = patches_by_gid(ax), texts_by_gid(ax)
    assert texts[f"table-label-{seq.seq_id}-0"] == "∅"
    assert f"arrow-{seq.seq_id}-0" not in texts and f"arrow-{seq.seq_id}-1" in texts


def test_swapped_sequence_under_a_sliding_window_keeps_its_null_entries():
    m = BlockManager(8, 4, num_cpu_blocks=8, sliding_window=6)
    seq = window_step(m, 9, 13)
    m.swap_out(seq)  # the table now holds CPU ids, and CPU block 0 is a real block
    view = snapshot(m, [seq])
    assert view.tables[0].num_released == 1
    assert set(view.cpu_refs) == set(seq.block_table[1:])
    texts = texts_by_gid(draw_block_tables(view))
    assert texts[f"table-label-{seq.seq_id}-0"] == "∅"
    assert texts[f"table-label-{seq.seq_id}-1"] == f"c{seq.block_table[1]}"


def test_draws_into_a_given_axes_and_rejects_bad_input():
    m, seqs, _ = seeds_scenario()
    fig, (left, right) = plt.subplots(1, 2)
    assert draw_pool(m, ax=left) is left
    assert draw_block_tables(m, seqs, ax=right) is right
    with pytest.raises(InvalidArgumentError, match="BlockManager"):
        draw_pool("not a manager")
    with pytest.raises(InvalidArgumentError, match="Sequence"):
        draw_block_tables(m, [1, 2])
    with pytest.raises(InvalidArgumentError, match="max_boxes"):
        draw_pool(m, max_boxes=0)
    with pytest.raises(InvalidArgumentError, match="snapshot"):
        draw_block_tables(snapshot(m, seqs), seqs)


def test_tables_use_the_notebooks_names():
    m = BlockManager(8, 4)
    a, b = Sequence(range(1, 9), 4), Sequence(range(1, 11), 4)
    m.allocate(a)
    m.allocate(b)
    by_list = [t.get_text() for t in draw_block_tables(m, [a, b], names=["A", "B"]).texts]
    assert any(t.startswith("A\n") for t in by_list) and any(t.startswith("B\n") for t in by_list)
    assert not any(t.startswith("seq ") for t in by_list)
    view = snapshot(m, [a, b], names={b.seq_id: "B"})  # a mapping may leave some out
    assert [t.display_name for t in view.tables] == [f"seq {a.seq_id}", "B"]
    with pytest.raises(InvalidArgumentError, match="names"):
        snapshot(m, [a, b], names=["A"])
    with pytest.raises(InvalidArgumentError, match="snapshot"):
        draw_block_tables(view, names=["A", "B"])
