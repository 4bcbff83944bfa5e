"""Notebook checks, picking up whatever notebooks/ holds.

1. Every notebooks/NAME.py (jupytext percent source) has a NAME.ipynb with the same cells, without
   outputs or execution counts, so the two sides cannot drift apart silently.
2. Every notebook runs top to bottom in a fresh kernel, with cwd = notebooks/ as in CI
   (marked `notebooks`: skip with `pytest -m "not notebooks"`).

Fix a failing sync test by editing the .py and running `make notebooks`.
"""

import json
import os
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = REPO / "notebooks"
SOURCES = sorted(NOTEBOOKS_DIR.glob("*.py"))
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
FIX = "edit the .py only, then run `make notebooks`"
# Per cell. Generous: on CPU the kernels run in the Triton interpreter on two shared cores.
CELL_TIMEOUT_S = 900
KERNEL_STARTUP_TIMEOUT_S = 180


def cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


@pytest.mark.parametrize("py", SOURCES, ids=lambda path: path.stem)
def test_ipynb_has_the_cells_of_its_py(py: Path) -> None:
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} is missing: run `make notebooks`"
    assert cells(nbformat.read(ipynb, as_version=4)) == cells(jupytext.read(py)), (
        f"{ipynb.name} and {py.name} have different cells: {FIX}"
    )


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda path: path.stem)
def test_ipynb_is_a_clean_twin_of_a_py(ipynb: Path) -> None:
    assert ipynb.with_suffix(".py").is_file(), f"{ipynb.name} has no .py source; the .py is the one to edit"
    nb = nbformat.read(ipynb, as_version=4)
    dirty = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, f"{ipynb.name}: cells {dirty} have outputs or execution counts: {FIX}"
    kernel = nb.metadata.get("kernelspec", {}).get("name")
    assert kernel == "python3", f"{ipynb.name}: kernelspec {kernel!r}, Colab needs 'python3': {FIX}"


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make kernel 'python3' this interpreter with this checkout's kvlab, whatever kernelspecs exist."""
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (kvlab tests)",
        "language": "python",
    }
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    def prepend(var: str, path: Path) -> None:
        monkeypatch.setenv(var, os.pathsep.join(filter(None, [str(path), os.environ.get(var)])))

    prepend("JUPYTER_PATH", tmp_path)  # JUPYTER_PATH is searched before user and system kernelspecs
    prepend("PYTHONPATH", REPO)  # the kernel's cwd is notebooks/, so kvlab must come from here
    monkeypatch.setenv("KVLAB_CI", "1")  # notebooks may shorten optional demos under test


@pytest.mark.notebooks
@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom(ipynb: Path, kernel_env: None) -> None:
    nb = nbformat.read(ipynb, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        startup_timeout=KERNEL_STARTUP_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
