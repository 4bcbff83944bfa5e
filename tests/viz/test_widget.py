"""Snapshots are frozen copies, and the step-through shows every one of them (grid) or one at a time (widget)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from kvlab import BlockManager, InvalidArgumentError, Sequence  # noqa: E402
from kvlab.viz import draw_pool, show_steps, snapshot, snapshot_grid, step_widget  # noqa: E402
from kvlab.viz.snapshot import FREE, SHARED, STATE_COLORS, USED  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def recorded_steps():
    m = BlockManager(6, 4)
    parent = Sequence(range(6), 4)
    child = Sequence([], 4)
    steps = []
    m.allocate(parent)
    steps.append(snapshot(m, [parent, child], "allocate"))
    m.fork(parent, child)
    steps.append(snapshot(m, [parent, child], "fork"))
    child.append_token(7)
    m.append_slots(child)
    steps.append(snapshot(m, [parent, child], "append (copy-on-write)"))
    m.free(parent)
    m.free(child)
    steps.append(snapshot(m, [parent, child], "free"))
    return steps, parent


def test_snapshots_do_not_follow_the_manager():
    steps, parent = recorded_steps()
    first, forked = steps[0], steps[1]
    assert first.tables[0].blocks == (0, 1) and first.tables[1].blocks == ()
    assert forked.refs[:2].tolist() == [2, 2] and first.refs[:2].tolist() == [1, 1]
    assert parent.block_table == () and steps[-1].refs.sum() == 0
    ax = draw_pool(first)
    assert {p.get_gid(): p for p in ax.patches}["pool-0"].get_facecolor() == to_rgba(STATE_COLORS[USED])
    ax = draw_pool(forked)
    assert {p.get_gid(): p for p in ax.patches}["pool-0"].get_facecolor() == to_rgba(STATE_COLORS[SHARED])
    assert forked.count(FREE) == 4


def test_grid_has_one_titled_panel_per_step():
    steps, _ = recorded_steps()
    fig = snapshot_grid(steps, ncols=3)
    titled = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titled == [f"({i}) {s.label}" for i, s in enumerate(steps)]
    assert len(fig.axes) == 6  # 2 rows of 3; the spare panels are blank
    assert show_steps(steps, interactive=False).axes[0].get_title() == "(0) allocate"


def test_widget_has_a_slider_over_all_steps():
    pytest.importorskip("ipywidgets")
    steps, _ = recorded_steps()
    box = step_widget(steps)
    slider = box.children[0]
    assert (slider.min, slider.max, slider.value) == (0, len(steps) - 1, 0)
    slider.value = 2  # redraws without error
    assert show_steps(steps, interactive=True).children[0].max == len(steps) - 1


def test_bad_input():
    with pytest.raises(InvalidArgumentError, match="no snapshots"):
        snapshot_grid([])
    with pytest.raises(InvalidArgumentError, match="PoolView"):
        snapshot_grid([BlockManager(2, 4)])
    steps, _ = recorded_steps()
    with pytest.raises(InvalidArgumentError, match="ncols"):
        snapshot_grid(steps, ncols=0)
