"""Regenerate notebooks/*.ipynb from their jupytext percent-format .py sources, and every notebook's setup cell
from the one below.

The .py file is the source of truth; the .ipynb is what Colab and Jupyter open. Generated notebooks have no
outputs, no execution counts, the metadata a JupyterLab save writes (METADATA; the .py gets HEADER) and cell
ids derived from the cell source, so regenerating, or opening and saving, an unchanged notebook changes no byte.

The first code cell of every notebook is its setup cell (make Colab find kvlab, show figures inline). It is
generated: ``SETUP_CELL`` below is the only copy to edit, and ``KVLAB_REPO_URL`` the only place that names the
repository. Syncing writes it into each .py (so the .py and a Jupyter session agree) and then into the
.ipynb. A new notebook needs only a placeholder first code cell that starts with ``# Setup``.

Usage: python scripts/sync_notebooks.py [notebooks/NAME.py ...]   (default: every notebooks/*.py)
"""

import hashlib
import re
import sys
from collections import Counter
from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"

#: Where Colab clones kvlab from. Change it here for a fork, then run `make notebooks`; the README's Colab
#: badges must name the same repository (a test checks).
KVLAB_REPO_URL = "https://github.com/kvlab/kvlab"

#: Every notebook's first code cell, as it appears in the .py (jupytext comments out the %-magic there).
SETUP_CELL = f'''\
# Setup (generated from scripts/sync_notebooks.py: edit it there, then `make notebooks`). In a checkout, or in
# CI, this uses the checkout's kvlab. On Colab it clones the repository (code and bundled traces) and installs
# kvlab's missing dependencies; Colab's torch and Triton are kept as they are. `%matplotlib inline` keeps
# figures in the notebook however it runs (Jupyter, Colab, nbconvert with MPLBACKEND=Agg).
# %matplotlib inline
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# The repository to clone when kvlab is not installed: for a fork, change it here or set $KVLAB_REPO.
KVLAB_REPO = os.environ.get("KVLAB_REPO", "{KVLAB_REPO_URL}")
if importlib.util.find_spec("kvlab") is None:
    checkout = Path.cwd().parent
    if not (checkout / "kvlab" / "__init__.py").is_file():  # not run from notebooks/ in a checkout
        checkout = Path.cwd() / "kvlab-repo"
        if not checkout.is_dir():
            clone = subprocess.run(["git", "clone", "-q", "--depth", "1", KVLAB_REPO, str(checkout)],
                                   capture_output=True, text=True)
            if clone.returncode != 0:
                raise RuntimeError(
                    f"Could not clone kvlab from {{KVLAB_REPO}}: {{clone.stderr.strip() or 'git failed'}}\\n"
                    "If your copy of kvlab lives elsewhere, set KVLAB_REPO in this cell to its address (or the "
                    "KVLAB_REPO environment variable), then run the cell again.") from None
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(checkout)])
    sys.path.insert(0, str(checkout))'''

#: The notebook metadata as JupyterLab 4 + jupytext save it, so that opening and saving a notebook changes no
#: byte of either file: JupyterLab sets `kernelspec` from the kernel's spec (ipykernel's default is named
#: "Python 3 (ipykernel)") and `language_info` from the kernel's reply, and jupytext adds `main_language`.
#: `version` is the project's Python: under another one, a save changes that one line of the .ipynb only.
METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
    "language_info": {
        "name": "python", "version": "3.11.7", "mimetype": "text/x-python", "file_extension": ".py",
        "codemirror_mode": {"name": "ipython", "version": 3}, "pygments_lexer": "ipython3",
        "nbconvert_exporter": "python",
    },
    # Lets Jupyter's jupytext extension keep both files in step when the notebook is edited there. The filter
    # keeps jupytext's version and the (machine-dependent) kernelspec out of the .py header.
    "jupytext": {"formats": "ipynb,py:percent", "main_language": "python",
                 "notebook_metadata_filter": "-jupytext.text_representation,-kernelspec"},
}

#: Every .py's header, as jupytext writes it on a save with the metadata above (generated like the setup cell).
HEADER = """\
# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---
"""
HEADER_BLOCK = re.compile(r"\A# ---\n(?:#.*\n)*?# ---\n")

CELL_MARKER = re.compile(r"^# %%(?P<rest>.*)$", re.MULTILINE)


class SetupCellError(ValueError):
    pass


def setup_cell_span(text: str) -> tuple[int, int]:
    """(start, end) of the first code cell's body in a percent-format source: from after its ``# %%`` line to
    the next cell marker, trailing blank lines excluded."""
    markers = list(CELL_MARKER.finditer(text))
    for k, marker in enumerate(markers):
        if marker.group("rest").strip().startswith("[markdown]"):
            continue
        start = marker.end() + 1
        end = markers[k + 1].start() if k + 1 < len(markers) else len(text)
        return start, start + len(text[start:end].rstrip("\n"))
    raise SetupCellError("has no code cell")


def setup_cell_of(text: str) -> str:
    start, end = setup_cell_span(text)
    return text[start:end]


def with_setup_cell(text: str) -> str:
    """``text`` with its first code cell replaced by SETUP_CELL (which must be a setup cell or a placeholder)."""
    start, end = setup_cell_span(text)
    if not text[start:end].startswith("# Setup"):
        raise SetupCellError("its first code cell must be the setup cell (a cell starting with '# Setup')")
    return text[:start] + SETUP_CELL + text[end:]


def with_header(text: str) -> str:
    """``text`` with its YAML header (if any) replaced by HEADER, then one blank line."""
    return HEADER + "\n" + HEADER_BLOCK.sub("", text, count=1).lstrip("\n")


def notebook_from_source(py: Path) -> nbformat.NotebookNode:
    nb = jupytext.read(py)
    nb.metadata = nbformat.from_dict(METADATA)
    nb.nbformat, nb.nbformat_minor = 4, 5  # 4.5: the first version with cell ids
    seen: Counter[str] = Counter()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        # Content-derived ids stay put when other cells are inserted; a suffix keeps duplicates unique.
        digest = hashlib.sha1(cell.source.encode()).hexdigest()[:12]
        cell.id = digest if seen[digest] == 0 else f"{digest}-{seen[digest]}"
        seen[digest] += 1
    return nb


def write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.write_text(text, encoding="utf-8")
    return True


def sync(py: Path) -> bool:
    """Give py the current header and setup cell, then write its .ipynb twin; return whether either file changed."""
    source_changed = write_if_changed(py, with_header(with_setup_cell(py.read_text(encoding="utf-8"))))
    text = nbformat.writes(notebook_from_source(py)) + "\n"
    return write_if_changed(py.with_suffix(".ipynb"), text) or source_changed


def main(args: list[str]) -> int:
    sources = [Path(a) for a in args] or sorted(NOTEBOOKS_DIR.glob("*.py"))
    for py in sources:
        if py.suffix != ".py" or not py.is_file():
            print(f"error: {py} is not a notebook .py source", file=sys.stderr)
            return 2
        try:
            changed = sync(py)
        except SetupCellError as error:
            print(f"error: {py}: {error}", file=sys.stderr)
            return 2
        print(f"{'updated  ' if changed else 'unchanged'} {py.with_suffix('.ipynb')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
