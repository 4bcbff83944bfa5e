"""Widgets only where a person is watching: headless runs (nbclient, CI) get one static run with the defaults."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab import InvalidArgumentError  # noqa: E402
from kvlab.viz import NotebookCheckError, Stops, check, explore, is_interactive  # noqa: E402
from kvlab.viz import interactive  # noqa: E402

plt.switch_backend("Agg")  # now, while IPython.get_ipython is real: pyplot hooks into a shell on first use


class FakeKernel:
    def __init__(self, allow_stdin):
        self._allow_stdin = allow_stdin


class FakeShell:
    def __init__(self, kernel):
        self.kernel = kernel


@pytest.fixture
def frontend(monkeypatch):
    """Pretend to run inside an IPython kernel whose current request came from a frontend with or without stdin."""
    pytest.importorskip("ipywidgets")
    import IPython

    for var in interactive.STATIC_ENV:
        monkeypatch.delenv(var, raising=False)
    plt.close("all")  # figures other tests left open must not count as explore's

    def use(allow_stdin):
        monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell(FakeKernel(allow_stdin)))
    return use


def test_a_live_frontend_is_interactive_and_a_headless_runner_is_not(frontend, monkeypatch):
    frontend(True)
    assert is_interactive()
    frontend(False)  # nbclient (nbconvert, papermill) sends allow_stdin=False
    assert not is_interactive()
    frontend(True)
    monkeypatch.setenv("CI", "true")
    assert not is_interactive()


def test_outside_a_kernel_nothing_is_interactive(monkeypatch):
    for var in interactive.STATIC_ENV:
        monkeypatch.delenv(var, raising=False)
    assert not is_interactive()  # pytest is not an IPython kernel


def test_explore_runs_once_with_the_defaults_when_headless(frontend, capsys):
    frontend(False)
    calls = []

    def draw(capacity=64, policy="lru"):
        calls.append((capacity, policy))
        return capacity

    assert explore(draw, capacity=(16, 256, 16), policy=["lru", "fifo"]) == 64
    assert calls == [(64, "lru")]
    assert "capacity=64, policy='lru'" in capsys.readouterr().out


def test_explore_gives_widgets_starting_at_the_defaults_when_live(frontend):
    frontend(True)
    calls = []

    def draw(capacity=64, policy="fifo", scale=0.5):
        calls.append((capacity, policy, scale))
        plt.figure()

    widget = explore(draw, capacity=(16, 256, 16), policy=["lru", "fifo"], scale=(0.1, 1.0, 0.1))
    by_name = {w.description: w for w in widget.children if hasattr(w, "description")}
    assert by_name["capacity"].value == 64 and not by_name["capacity"].continuous_update
    assert by_name["policy"].value == "fifo" and list(by_name["policy"].options) == ["lru", "fifo"]
    assert by_name["scale"].value == 0.5
    by_name["capacity"].value = 128  # moving a slider reruns the function
    assert calls[0] == (64, "fifo", 0.5) and calls[-1] == (128, "fifo", 0.5)
    assert not plt.get_fignums()  # each figure was shown and closed, none piles up


def test_explore_returns_the_widget_not_the_function(frontend):
    """ipywidgets' interact returns the function, which a cell then shows as `Out[n]: <function ...>`."""
    frontend(True)

    def draw(capacity=64):
        return None

    widget = explore(draw, capacity=(16, 256, 16))
    assert not callable(widget) and widget.children[0].description == "capacity"
    # Already on screen: as a cell's last value it shows nothing more (IPython calls _ipython_display_).
    assert widget._ipython_display_() is None


def test_stops_slide_over_the_given_values_and_start_at_the_default(frontend):
    frontend(True)
    np = pytest.importorskip("numpy")
    sizes = np.unique(np.geomspace(1_000, 50_000, 9).astype(int))
    seen = []

    def draw(pool_blocks=int(sizes[4])):
        seen.append(pool_blocks)

    slider = explore(draw, pool_blocks=Stops(sizes)).children[0]
    assert slider.value == sizes[4] and [label for label, _ in slider.options][:2] == ["1,000", "1,630"]
    slider.value = int(sizes[-1])
    assert seen == [sizes[4], sizes[-1]] and type(seen[-1]) is int


def test_a_default_off_the_step_grid_is_a_stop_of_its_own(frontend):
    """A (min, max, step) slider starting off its grid could never be dragged back to the default."""
    frontend(True)

    def draw(pool_blocks=17_985, share=0.125):
        return None

    box = explore(draw, pool_blocks=(1_000, 50_000, 1_000), share=(0.02, 0.2, 0.02))
    by_name = {w.description: w for w in box.children if hasattr(w, "description")}
    assert by_name["pool_blocks"].value == 17_985
    values = [v for _, v in by_name["pool_blocks"].options]
    assert values[:3] == [1_000, 2_000, 3_000] and 17_985 in values and values[-1] == 50_000
    assert [label for label, _ in by_name["share"].options] == [
        "0.02", "0.04", "0.06", "0.08", "0.1", "0.12", "0.125", "0.14", "0.16", "0.18", "0.2"]


@pytest.mark.parametrize("knobs, message", [
    (dict(missing=(1, 2, 1)), "must be a parameter"),
    (dict(capacity=(100, 200, 10)), "not among"),
    (dict(policy=["fifo"]), "not among"),
    (dict(capacity=(16, 256)), "must be \\(min, max, step\\)"),
    (dict(capacity=(256, 16, 16)), "min < max and step > 0"),
    (dict(capacity=(16, 256, 0)), "min < max and step > 0"),
    (dict(policy="lru"), "must be \\(min, max, step\\)"),
    (dict(capacity=Stops([16, 32])), "not among Stops"),
])
def test_explore_refuses_knobs_it_cannot_start_from(knobs, message):
    def draw(capacity=64, policy="lru", nodefault=None):
        return None

    with pytest.raises(InvalidArgumentError, match=message):
        explore(draw, **knobs)


@pytest.mark.parametrize("values", [[1], [1, 1, 2], [], range(2000), [[1], [2]]])
def test_stops_need_a_few_distinct_values(values):
    with pytest.raises(InvalidArgumentError, match="Stops needs"):
        Stops(values)


def test_a_huge_grid_with_an_off_grid_default_is_refused():
    def draw(share=0.125):
        return None

    with pytest.raises(InvalidArgumentError, match="off the grid"):
        explore(draw, share=(0.0, 1000.0, 0.01))


def test_check_fails_only_with_the_defaults(capsys):
    check(True, "never shown", defaults=True)
    with pytest.raises(NotebookCheckError, match="B hit 4 tokens"):
        check(False, "B hit 4 tokens", defaults=True)
    check(False, "B hit 4 tokens: blocks of 8 hold A's prefix in one block", defaults=False)
    assert "Changed by your settings: B hit 4 tokens" in capsys.readouterr().out
