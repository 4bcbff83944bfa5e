"""``explore`` in a real kernel whose frontend can answer ``input()``, as JupyterLab's can (issue 30 §1-2).

The test plays the frontend: it sends cells with allow_stdin=True and reads the kernel's iopub messages, which is
what JupyterLab renders and what its saved .ipynb keeps (display_data outputs, never widget state).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from kvlab.viz.interactive import REOPENED_NOTE

pytest.importorskip("ipywidgets")
from jupyter_client.manager import start_new_kernel  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

CELL = '''
import matplotlib.pyplot as plt
from kvlab import viz

def draw(n=2, policy="lru"):
    plt.plot(range(n + 1), color="red" if n > 2 else "blue")
    plt.show()
    print(f"drew n={n}, {policy}")

viz.explore(draw, n=viz.Stops([1, 2, 4, 8]), policy=["lru", "fifo"])
'''


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernel running this interpreter with this checkout's kvlab, without the settings that make it static."""
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps(
        {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "Python 3 (kvlab tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVLAB_CI", "MPLBACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=180, env=env, cwd=str(tmp_path))
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def run(client, code: str, errors: bool = False) -> list[dict]:
    """Execute ``code`` as a person's frontend does (stdin allowed); return its iopub messages until idle
    (failing on an error message unless ``errors``)."""
    msg_id = client.execute(code, allow_stdin=True)
    messages = []
    while True:
        msg = client.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        assert errors or msg["msg_type"] != "error", "\n".join(msg["content"]["traceback"])
        messages.append(msg)


def contents(messages, msg_type):
    return [m["content"] for m in messages if m["msg_type"] == msg_type]


def test_live_explore_keeps_its_figure_as_an_output_and_shows_no_stray_value(kernel):
    shown = run(kernel, CELL)
    # §1: the cell's last value (the widget explore returns) adds no Out[n], neither a function nor a 2nd view.
    assert not contents(shown, "execute_result")
    displays = contents(shown, "display_data")
    assert WIDGET_VIEW in displays[0]["data"]  # the sliders come first, as the one widget view
    assert sum(WIDGET_VIEW in d["data"] for d in displays) == 1
    # §2: the figure and fn's printout are ordinary outputs (what a saved .ipynb keeps), each with a display id.
    figures = [d for d in displays if "image/png" in d["data"]]
    texts = [d for d in displays if d["data"].get("text/plain", "").startswith("drew")]
    assert len(figures) == 1 and figures[0]["transient"]["display_id"]
    assert texts and texts[0]["data"]["text/plain"] == "drew n=2, lru\n"
    assert REOPENED_NOTE in "".join(s["text"] for s in contents(shown, "stream"))
    # In a new kernel one cell alone raises NameError on the cells before it and erases the saved figure.
    assert "Run All Cells" in REOPENED_NOTE and "run this cell" not in REOPENED_NOTE

    # Moving a slider (JupyterLab sets the value through the widget's comm) redraws those same outputs in place.
    moved = run(kernel, "box = _\nbox.children[0].value = 8")
    updates = {u["transient"]["display_id"]: u["data"] for u in contents(moved, "update_display_data")}
    assert updates[figures[0]["transient"]["display_id"]]["image/png"] != figures[0]["data"]["image/png"]
    assert updates[texts[0]["transient"]["display_id"]]["text/plain"] == "drew n=8, lru\n"
    assert not contents(moved, "display_data")  # nothing new appears below


def test_an_error_while_redrawing_shows_under_the_sliders(kernel):
    run(kernel, "from kvlab import viz\n"
                "def draw(n=1):\n    if n > 1:\n        raise RuntimeError(f'no n={n}')\n    print('fine')\n"
                "box = viz.explore(draw, n=(1, 3, 1))")
    # Set as JupyterLab sets it (through the widget's comm), the error would only reach the kernel's log; here it
    # must not escape the callback either (the cell goes on) and is shown in the Output widget below the sliders.
    moved = run(kernel, "box.children[0].value = 2\nprint('went on')", errors=True)
    errors = contents(moved, "error")
    assert errors and "no n=2" in errors[0]["evalue"] + "".join(errors[0]["traceback"])
    assert "went on" in "".join(s["text"] for s in contents(moved, "stream"))


def test_the_live_snapshot_slider_keeps_its_figure_too(kernel):
    shown = run(kernel, "from kvlab import BlockManager, Sequence, viz\n"
                        "m, seq = BlockManager(6, 4), Sequence(range(6), 4)\n"
                        "steps = [viz.snapshot(m, [seq], 'empty')]\n"
                        "m.allocate(seq)\n"
                        "steps.append(viz.snapshot(m, [seq], 'allocated'))\n"
                        "viz.show_steps(steps)")
    assert not contents(shown, "execute_result")
    figures = [d for d in contents(shown, "display_data") if "image/png" in d["data"]]
    assert len(figures) == 1 and figures[0]["transient"]["display_id"]
    moved = run(kernel, "_.children[0].value = 1")
    updates = contents(moved, "update_display_data")
    assert [u["transient"]["display_id"] for u in updates] == [figures[0]["transient"]["display_id"]]
