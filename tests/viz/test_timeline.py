"""kvlab.viz.draw_timeline: one mark per recorded event in its kind's row, labelled; long logs aggregated."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvlab import BlockManager, Event, InvalidArgumentError, Sequence  # noqa: E402
from kvlab.viz import EVENT_KINDS, draw_timeline, event_label  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def forked_and_swapped() -> BlockManager:
    """A run that records most kinds: allocate/miss/seal, hit, fork + cow, free/release, swap out/in."""
    m = BlockManager(10, 4, num_cpu_blocks=10, record_events=True)
    a = Sequence(range(1, 11), 4)
    m.allocate(a)
    b = Sequence(range(1, 7), 4)
    m.allocate(b)  # hits a's first block
    child = Sequence([], 4)
    m.fork(a, child)
    child.append_token(42)
    m.append_slots(child)  # copy-on-write of the shared partial block
    m.swap_out(a)
    m.swap_in(a)
    m.free(b)
    return m


def test_each_event_is_one_mark_in_its_kinds_row():
    m = forked_and_swapped()
    ax = draw_timeline(m)
    rows = [t.get_text() for t in ax.get_yticklabels()]
    kinds = {e.kind for e in m.events}
    assert rows == [k for k in EVENT_KINDS if k in kinds]
    for collection in ax.collections:
        kind = collection.get_gid().removeprefix("events-")
        offsets = collection.get_offsets()
        expected_x = [t for t, e in enumerate(m.events) if e.kind == kind]
        assert offsets[:, 0].tolist() == expected_x
        assert set(offsets[:, 1].tolist()) == {rows.index(kind)}
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(m.events)
    labels = {t.get_gid(): t.get_text() for t in ax.texts}
    assert all(labels[f"event-{t}"] == event_label(e) for t, e in enumerate(m.events))


def test_labels_name_sequences_copies_and_blocks():
    assert event_label(Event("fork", 5, None, 2)) == "s5<s2"
    assert event_label(Event("cow", 5, 9, 3)) == "3>9"
    assert event_label(Event("swap_out", 5, 4, 1)) == "4>c1"
    assert event_label(Event("swap_in", 5, 7, 1)) == "c1>7"
    assert event_label(Event("hit", 5, 8)) == "8"
    assert event_label(Event("free", 5)) == "s5"


def test_labels_name_the_offload_tiers_moves_not_none():
    assert event_label(Event("offload", block_id=4, other=2)) == "4>c2"
    assert event_label(Event("promote", block_id=7, other=2)) == "c2>7"
    assert event_label(Event("tier_evict", other=3)) == "c3"


def test_kinds_choose_and_order_the_rows():
    m = forked_and_swapped()
    ax = draw_timeline(m, kinds=["cow", "hit"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cow", "hit"]
    assert sum(len(c.get_offsets()) for c in ax.collections) == sum(e.kind in ("cow", "hit") for e in m.events)


def test_long_logs_become_a_count_heatmap():
    m = BlockManager(64, 4, record_events=True)
    rng = np.random.default_rng(3)
    for _ in range(200):
        s = Sequence(rng.integers(0, 3, size=int(rng.integers(3, 30))), 4)
        m.allocate(s)
        m.free(s)
    assert len(m.events) > 300
    ax = draw_timeline(m, max_marks=300, bins=50)
    counts = ax.get_images()[0].get_array()
    assert counts.shape == (len({e.kind for e in m.events}), 50)
    assert counts.sum() == len(m.events)
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert counts[rows.index("hit")].sum() == sum(e.kind == "hit" for e in m.events)


def test_empty_log_and_bad_input():
    draw_timeline(BlockManager(4, 4, record_events=True))
    draw_timeline([])
    with pytest.raises(InvalidArgumentError, match="record_events=True"):
        draw_timeline(BlockManager(4, 4))
    with pytest.raises(InvalidArgumentError, match="Event"):
        draw_timeline([("hit", 1, 2, None)])
    with pytest.raises(InvalidArgumentError, match="kinds"):
        draw_timeline([], kinds=[])


def test_names_and_phases_tell_which_operation_caused_which_events():
    m = BlockManager(8, 4, record_events=True)
    x, y = Sequence(range(1, 10), 4), Sequence(range(50, 55), 4)
    phases = [(len(m.events), "X and Y arrive")]
    m.allocate(x)
    m.allocate(y)
    phases.append((len(m.events), "X freed"))
    m.free(x)
    names = {x.seq_id: "X", y.seq_id: "Y"}
    ax = draw_timeline(m, names=names, phases=phases)
    labels = {t.get_gid(): t.get_text() for t in ax.texts}
    allocations = [t for t, e in enumerate(m.events) if e.kind == "allocate"]
    assert [labels[f"event-{t}"] for t in allocations] == ["X", "Y"]
    assert labels[f"event-{len(m.events) - 1}"] == "X"  # the free
    captions = [a for a in ax.texts if (a.get_gid() or "").startswith("phase-label")]
    assert [c.get_text() for c in captions] == ["X and Y arrive", "X freed"]
    # Each caption sits over its phase's events: the middle of [start, next start).
    assert captions[1].xy[0] == pytest.approx((phases[1][0] + len(m.events) - 1) / 2)
    assert "allocate, free: sequence" in ax.get_xlabel() and "physical block id" in ax.get_xlabel()
    assert event_label(Event("fork", 5, None, 2), {5: "B", 2: "A"}) == "B<A"
    with pytest.raises(InvalidArgumentError, match="phases"):
        draw_timeline(m, phases=[(len(m.events) + 1, "after the end")])
