"""Execute notebooks headless, as CI does, and write each with its outputs to docs/rendered/NAME.ipynb.

GitHub shows an .ipynb with its outputs, so a reader browsing the repository sees every figure without running
anything. The copies are executed from the generated notebooks/NAME.ipynb (run `make notebooks` first) with CI's
settings (KVLAB_CI=1: widgets fall back to one static run with the defaults, optional demos are shortened), in a
kernel started from this interpreter with this checkout's kvlab, cwd notebooks/. Figures are drawn at DPI, so
each copy stays under MAX_NOTEBOOK_BYTES and all of them under MAX_TOTAL_BYTES; progress bars (widgets, blank
without a kernel) are left out. tests/test_rendered_notebooks.py checks the bounds and that every copy has its
notebook's current cells.

Usage: python scripts/render_notebooks.py [notebooks/NAME.py ...]   (default: every notebook; `make render`)
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = REPO / "notebooks"
RENDERED_DIR = REPO / "docs" / "rendered"
#: Enough to read every label on a laptop screen; the bounds below were measured with it.
DPI = 72
MAX_NOTEBOOK_BYTES = 2_000_000
MAX_TOTAL_BYTES = 15_000_000
CELL_TIMEOUT_S = 900
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def kernel_environment(scratch: Path) -> dict[str, str]:
    """Environment variables for the rendering kernel: a 'python3' kernelspec running this interpreter, this
    checkout's kvlab, CI's settings and DPI for every figure."""
    spec_dir = scratch / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps(
        {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "Python 3 (kvlab render)", "language": "python"}))
    (scratch / "matplotlibrc").write_text(f"figure.dpi: {DPI}\nsavefig.dpi: figure\n")
    return {
        "JUPYTER_PATH": os.pathsep.join(filter(None, [str(scratch), os.environ.get("JUPYTER_PATH")])),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "KVLAB_CI": "1",
        "MPLBACKEND": "Agg",  # as in CI; the setup cell's %matplotlib inline keeps the figures
        "MATPLOTLIBRC": str(scratch),
    }


def render(ipynb: Path) -> nbformat.NotebookNode:
    """``ipynb`` executed top to bottom, its outputs kept (raises CellExecutionError where a cell fails), except
    widget views (tqdm's progress bars): without the kernel they show only their first state or an error."""
    nb = nbformat.read(ipynb, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=180,
                   record_timing=False, store_widget_state=False,
                   resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [out for out in cell.outputs if WIDGET_VIEW not in out.get("data", {})]
    # Not a jupytext pair (saving it in Jupyter must not write a .py beside it); say where it comes from.
    nb.metadata.pop("jupytext", None)
    nb.metadata["kvlab"] = {"rendered_from": f"notebooks/{ipynb.with_suffix('.py').name}", "regenerate": "make render"}
    return nb


def main(args: list[str]) -> int:
    sources = [Path(a) for a in args] or sorted(NOTEBOOKS_DIR.glob("*.py"))
    for py in sources:
        if py.suffix != ".py" or not py.with_suffix(".ipynb").is_file():
            print(f"error: {py} is not a notebook .py source with its .ipynb (run `make notebooks`)", file=sys.stderr)
            return 2
    RENDERED_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        os.environ.update(kernel_environment(Path(scratch)))
        for py in sources:
            start = time.perf_counter()
            target = RENDERED_DIR / py.with_suffix(".ipynb").name
            nbformat.write(render(py.with_suffix(".ipynb")), target)
            print(f"rendered {target.relative_to(REPO)} in {time.perf_counter() - start:.0f} s, "
                  f"{target.stat().st_size / 1e6:.2f} MB")
    total = sum(path.stat().st_size for path in RENDERED_DIR.glob("*.ipynb"))
    print(f"docs/rendered/ holds {total / 1e6:.1f} MB (bound: {MAX_TOTAL_BYTES / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
