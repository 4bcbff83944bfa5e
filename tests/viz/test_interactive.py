"""Widgets only where a person is watching: headless runs (nbclient, CI) get one static run with the defaults."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab import InvalidArgumentError  # noqa: E402
from kvlab.viz import NotebookCheckError, check, explore, is_interactive  # noqa: E402
from kvlab.viz import interactive  # noqa: E402


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
        plt.close("all")

    widget = explore(draw, capacity=(16, 256, 16), policy=["lru", "fifo"], scale=(0.1, 1.0, 0.1))
    by_name = {w.description: w for w in widget.widget.children if hasattr(w, "description")}
    assert by_name["capacity"].value == 64 and not by_name["capacity"].continuous_update
    assert by_name["policy"].value == "fifo" and list(by_name["policy"].options) == ["lru", "fifo"]
    assert by_name["scale"].value == 0.5
    by_name["capacity"].value = 128  # moving a slider reruns the function
    assert calls[0] == (64, "fifo", 0.5) and calls[-1] == (128, "fifo", 0.5)


@pytest.mark.parametrize("knobs", [dict(missing=(1, 2, 1)), dict(capacity=(100, 200, 10)), dict(policy=["fifo"])])
def test_explore_refuses_knobs_it_cannot_start_from(knobs):
    def draw(capacity=64, policy="lru", nodefault=None):
        return None

    with pytest.raises(InvalidArgumentError):
        explore(draw, **knobs)


def test_check_fails_only_with_the_defaults(capsys):
    check(True, "never shown", defaults=True)
    with pytest.raises(NotebookCheckError, match="B hit 4 tokens"):
        check(False, "B hit 4 tokens", defaults=True)
    check(False, "B hit 4 tokens: blocks of 8 hold A's prefix in one block", defaults=False)
    assert "Changed by your settings: B hit 4 tokens" in capsys.readouterr().out
