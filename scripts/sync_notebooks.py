"""Regenerate notebooks/*.ipynb from their jupytext percent-format .py sources.

The .py file is the source of truth; the .ipynb is what Colab and Jupyter open. Generated notebooks
have no outputs, no execution counts, minimal metadata (python3 kernelspec plus the jupytext pairing)
and cell ids derived from the cell source, so regenerating an unchanged notebook changes no byte.

Usage: python scripts/sync_notebooks.py [notebooks/NAME.py ...]   (default: every notebooks/*.py)
"""

import hashlib
import sys
from collections import Counter
from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"

METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
    # Lets Jupyter's jupytext extension keep both files in step when the notebook is edited there.
    "jupytext": {"formats": "ipynb,py:percent"},
}


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


def sync(py: Path) -> bool:
    """Write py's .ipynb twin; return whether its content changed."""
    text = nbformat.writes(notebook_from_source(py)) + "\n"
    ipynb = py.with_suffix(".ipynb")
    if ipynb.exists() and ipynb.read_text(encoding="utf-8") == text:
        return False
    ipynb.write_text(text, encoding="utf-8")
    return True


def main(args: list[str]) -> int:
    sources = [Path(a) for a in args] or sorted(NOTEBOOKS_DIR.glob("*.py"))
    for py in sources:
        if py.suffix != ".py" or not py.is_file():
            print(f"error: {py} is not a notebook .py source", file=sys.stderr)
            return 2
        print(f"{'updated  ' if sync(py) else 'unchanged'} {py.with_suffix('.ipynb')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
