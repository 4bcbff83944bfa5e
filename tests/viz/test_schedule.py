"""draw_schedule: one cell per (request, step) in the state's colour, preemptions marked."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from kvlab import InvalidArgumentError  # noqa: E402
from kvlab.viz import SCHEDULE_STATES, draw_schedule  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_cells_follow_each_request_through_the_steps():
    frame = pd.DataFrame([
        (0, "A", "prefill", False), (0, "B", "waiting", False),
        (1, "A", "decode", False), (1, "B", "prefill", False),
        (2, "A", "decode", False), (2, "B", "waiting", True),
        (3, "A", "decode", False), (3, "B", "recompute", False),
    ], columns=["step", "request", "state", "preempted"])
    ax = draw_schedule(frame)
    cells = {p.get_gid(): p for p in ax.patches}
    assert len(cells) == len(frame)
    for step, request, state, _ in frame.itertuples(index=False):
        cell = cells[f"cell-{request}-{step}"]
        assert cell.get_facecolor() == to_rgba(SCHEDULE_STATES[state])
        assert cell.get_x() == pytest.approx(step - 0.45)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["A", "B"]
    marks = [c for c in ax.collections if c.get_gid() == "preemptions"][0].get_offsets()
    assert marks.tolist() == [[2, 1]]  # B, preempted in step 2
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == 5 and legend[-1] == "preempted in this step"


def test_bad_frames():
    with pytest.raises(InvalidArgumentError, match="missing"):
        draw_schedule(pd.DataFrame({"step": [0], "request": ["A"]}))
    with pytest.raises(InvalidArgumentError, match="unknown states"):
        draw_schedule(pd.DataFrame({"step": [0], "request": ["A"], "state": ["sleeping"]}))


def test_waiting_mentions_recompute_only_where_a_request_was_recomputed():
    """A swap run's legend must not say its waiting requests were preempted by recompute."""
    def legend(states):
        frame = pd.DataFrame([(i, "A", s) for i, s in enumerate(states)], columns=["step", "request", "state"])
        return [t.get_text() for t in draw_schedule(frame).get_legend().get_texts()]
    swap_run = legend(["waiting", "prefill", "swapped", "decode"])
    assert "queued (not admitted yet)" in swap_run and not any("recompute" in t for t in swap_run)
    assert "queued (not admitted yet, or preempted by recompute)" in legend(["prefill", "waiting", "recompute"])
