"""What the notebook tests compare: a notebook's cells, and the cells that show a figure but kept none."""

import re

import nbformat

# A line that shows a figure whenever its cell runs: not indented (so not inside an if, loop or function).
SHOWS_A_FIGURE = re.compile(r"^plt\.show\(\)", re.MULTILINE)


def cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """(type, source) of each cell: what a .py, its .ipynb and its rendering must agree on."""
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def cells_missing_figures(nb: nbformat.NotebookNode) -> list[int]:
    """Code cells that show a figure unconditionally but kept no PNG output."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and SHOWS_A_FIGURE.search(cell.source)
            and not any("image/png" in out.get("data", {}) for out in cell.outputs)]
