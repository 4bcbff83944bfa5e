"""docs/rendered/ holds every notebook executed, with its figures, for readers who run nothing (GitHub shows them).

These checks execute nothing (fast, not marked `notebooks`), and they FAIL, never skip, on main:
1. every notebooks/NAME.py has docs/rendered/NAME.ipynb, and no rendering outlives its notebook;
2. each rendering has its notebook's current cells (a notebook edited after its rendering fails), every code
   cell executed in order, and a PNG under every cell that shows a figure;
3. sizes stay bounded: MAX_NOTEBOOK_BYTES each, MAX_TOTAL_BYTES together.
Fix a failure with `make render` (scripts/render_notebooks.py), then commit docs/rendered/.
The last test runs the renderer itself on a tiny notebook.
"""

import base64
import struct
from pathlib import Path

import jupytext
import nbformat
import pytest

from notebook_cells import cells, cells_missing_figures
from repo_scripts import load_script

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted((REPO / "notebooks").glob("*.py"))
RENDER = "run `make render` (or scripts/render_notebooks.py notebooks/NAME.py) and commit docs/rendered/"
render_notebooks = load_script("render_notebooks")
RENDERED = sorted(render_notebooks.RENDERED_DIR.glob("*.ipynb"))


@pytest.mark.parametrize("py", SOURCES, ids=lambda path: path.stem)
def test_every_notebook_has_a_fresh_rendering(py: Path) -> None:
    rendered = render_notebooks.RENDERED_DIR / py.with_suffix(".ipynb").name
    assert rendered.is_file(), f"{py.name} has no rendering in docs/rendered/: {RENDER}"
    nb = nbformat.read(rendered, as_version=4)
    assert cells(nb) == cells(jupytext.read(py)), f"{rendered.name} is stale: {py.name} changed since: {RENDER}"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert None not in counts and counts == sorted(counts), f"{rendered.name} was not run top to bottom: {RENDER}"
    bare = cells_missing_figures(nb)
    assert not bare, f"{rendered.name}: cells {bare} show a figure but kept none: {RENDER}"


@pytest.mark.parametrize("rendered", RENDERED, ids=lambda path: path.stem)
def test_every_rendering_has_a_notebook(rendered: Path) -> None:
    assert (REPO / "notebooks" / rendered.with_suffix(".py").name).is_file(), (
        f"{rendered.name} renders a notebook that no longer exists: delete it")


def test_renderings_stay_small() -> None:
    sizes = {path.name: path.stat().st_size for path in RENDERED}
    big = {name: size for name, size in sizes.items() if size > render_notebooks.MAX_NOTEBOOK_BYTES}
    assert not big, f"renderings over {render_notebooks.MAX_NOTEBOOK_BYTES:,} bytes: {big} (lower DPI or the figures)"
    total = sum(sizes.values())
    assert total <= render_notebooks.MAX_TOTAL_BYTES, f"docs/rendered/ holds {total:,} bytes"


def test_the_renderer_keeps_figures_at_its_dpi_and_drops_widgets(tmp_path: Path, monkeypatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for var, value in render_notebooks.kernel_environment(scratch).items():
        monkeypatch.setenv(var, value)
    nb = nbformat.v4.new_notebook(metadata={"jupytext": {"formats": "ipynb,py:percent"}}, cells=[
        nbformat.v4.new_code_cell("%matplotlib inline\nimport matplotlib.pyplot as plt\nfrom tqdm.auto import tqdm"),
        nbformat.v4.new_code_cell("for _ in tqdm(range(3)):\n    pass\n"
                                  "plt.figure(figsize=(2, 1))\nplt.plot([0, 1])\nplt.show()")])
    ipynb = tmp_path / "tiny.ipynb"
    nbformat.write(nb, ipynb)
    out = render_notebooks.render(ipynb)
    outputs = out.cells[1].outputs
    assert not any(render_notebooks.WIDGET_VIEW in o.get("data", {}) for o in outputs)  # tqdm's bar is gone
    png = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(png) == 1
    width = struct.unpack(">I", base64.b64decode(png[0].data["image/png"])[16:20])[0]  # the PNG header's IHDR
    assert 1.5 * render_notebooks.DPI < width <= 2 * render_notebooks.DPI  # 2 inches wide, cropped to the drawing
    assert "jupytext" not in out.metadata and out.metadata["kvlab"]["rendered_from"] == "notebooks/tiny.py"
