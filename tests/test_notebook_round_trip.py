"""Opening a notebook in JupyterLab and saving it changes no byte of its .ipynb or its .py (issue 30 §5).

JupyterLab 4 loads the notebook through jupytext's contents manager (which reads the .py for the inputs), then
sets two metadata keys once the kernel is up: `kernelspec` from the kernel's spec and `language_info` from the
kernel's info reply; a save PUTs the notebook back and jupytext rewrites both files. The tests do the same with
jupytext's contents manager in-process, so a generated pair must already be what a save writes.
"""

import json
import shutil
from pathlib import Path

import pytest
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelspec import get_kernel_dict
from jupytext import TextFileContentsManager

from repo_scripts import load_script

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted((REPO / "notebooks").glob("*.py"))


sync_notebooks = load_script("sync_notebooks")


def what_jupyterlab_sets() -> dict:
    """The metadata JupyterLab writes once ipykernel's default kernel is up (its NotebookPanel's _updateSpec and
    _updateLanguage). The Python version is the generated one: under another Python only that line may differ."""
    spec = get_kernel_dict()
    language_info = IPythonKernel.language_info | {"version": sync_notebooks.METADATA["language_info"]["version"]}
    return {"kernelspec": {"name": "python3", "display_name": spec["display_name"], "language": spec["language"]},
            "language_info": language_info}


@pytest.mark.parametrize("py", SOURCES, ids=lambda path: path.stem)
def test_every_py_starts_with_the_generated_header(py: Path) -> None:
    assert py.read_text(encoding="utf-8").startswith(sync_notebooks.HEADER + "\n"), (
        f"{py.name}: its header differs from scripts/sync_notebooks.py's HEADER: run `make notebooks`")


@pytest.mark.parametrize("kernel_started", [False, True], ids=["opened", "kernel started"])
@pytest.mark.parametrize("py", SOURCES, ids=lambda path: path.stem)
def test_open_and_save_in_jupyterlab_changes_no_byte(py: Path, kernel_started: bool, tmp_path: Path) -> None:
    for twin in (py, py.with_suffix(".ipynb")):
        shutil.copy(twin, tmp_path / twin.name)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    manager = TextFileContentsManager(root_dir=str(tmp_path))
    name = py.with_suffix(".ipynb").name
    content = manager.get(name, content=True, type="notebook")["content"]
    if kernel_started:
        content.metadata.update(what_jupyterlab_sets())
    # What the browser sends back: plain JSON.
    manager.save({"type": "notebook", "format": "json", "content": json.loads(json.dumps(content))}, name)
    after = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    changed = sorted(n for n in before if after[n] != before[n])
    assert not changed, f"a save without edits rewrote {changed}: run `make notebooks` (see METADATA and HEADER)"


def test_with_header_replaces_any_header_and_keeps_the_cells() -> None:
    body = "# %% [markdown]\n# # Title\n"
    old = "# ---\n# jupyter:\n#   kernelspec:\n#     name: python3\n# ---\n" + body  # no blank line after it
    assert sync_notebooks.with_header(old) == sync_notebooks.HEADER + "\n" + body
    assert sync_notebooks.with_header(body) == sync_notebooks.HEADER + "\n" + body
    assert sync_notebooks.with_header(sync_notebooks.with_header(old)) == sync_notebooks.with_header(old)
