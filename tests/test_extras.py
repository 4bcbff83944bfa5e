"""kvlab's optional dependencies (pyproject's extras) are optional: `import kvlab` and every notebook that does not
get an extra on Colab import without that extra's modules, and the extras named in pyproject.toml are the ones
scripts/sync_notebooks.py installs by module.

A module is "hidden" by a meta-path finder that refuses it, in a fresh interpreter, as if it were not installed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from repo_scripts import load_script

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.py"))
sync_notebooks = load_script("sync_notebooks")
HIDE = '''
import importlib, importlib.abc, sys
HIDDEN = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: an extra that is not installed)", name=name)
sys.meta_path.insert(0, Hide())
'''
IMPORT_ALL = "for name in sys.argv[2:]:\n    importlib.import_module(name)\n"


def run_without(hidden: set[str], code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the modules ``hidden`` cannot be imported."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", HIDE + code, ",".join(sorted(hidden)), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def import_without(hidden: set[str], modules: list[str]) -> subprocess.CompletedProcess:
    return run_without(hidden, IMPORT_ALL, *modules)


def requirement_modules(requirements: list[str]) -> set[str]:
    """'dask[distributed]>=2024.1' -> {'dask', 'distributed'}: the distributions an extra brings, which here are
    also the names of the modules they install."""
    names = set()
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", requirement)
        names.add(match.group(1).lower())
        names.update(extra.strip().lower() for extra in (match.group(2) or "").split(",") if extra.strip())
    return names


def test_the_extras_in_pyproject_are_the_ones_the_setup_cell_installs_by_module() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    for extra, modules in sync_notebooks.EXTRA_MODULES.items():
        assert requirement_modules(extras[extra]) == set(modules), f"pyproject's [{extra}] and EXTRA_MODULES differ"
    core = requirement_modules(project["dependencies"])
    every_extra_module = {m for modules in sync_notebooks.EXTRA_MODULES.values() for m in modules}
    assert not core & every_extra_module, f"{core & every_extra_module} are both core and in an extra"


def test_the_core_imports_without_any_extra() -> None:
    hidden = {m for modules in sync_notebooks.EXTRA_MODULES.values() for m in modules}
    core = ["kvlab", "kvlab.blocks", "kvlab.kernels", "kvlab.studies", "kvlab.studies.cli", "kvlab.studies.overlap",
            "kvlab.studies.fleet_cli", "kvlab.sizing", "kvlab.viz", "kvlab.engine", "kvlab.cli", "kvlab.__main__"]
    run = import_without(hidden, core)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_hidden_module_cannot_be_imported() -> None:
    """The check above can fail: a module of a hidden extra really is refused."""
    run = import_without({"safetensors"}, ["safetensors"])
    assert run.returncode != 0 and "hidden: an extra that is not installed" in run.stderr


def notebook_imports(py: Path) -> tuple[tuple[str, ...], list[str]]:
    """(the extras its setup cell installs, the modules the rest of the notebook imports)."""
    text = py.read_text(encoding="utf-8")
    body = text.replace(sync_notebooks.setup_cell_of(text), "")
    modules = sorted({a or b for a, b in sync_notebooks.IMPORT.findall(body)})
    return sync_notebooks.extras_of(body), modules


@pytest.mark.parametrize("extras", sorted({notebook_imports(py)[0] for py in NOTEBOOKS}), ids=repr)
def test_each_notebook_imports_with_only_the_extras_its_setup_cell_installs(extras: tuple[str, ...]) -> None:
    """One interpreter per set of extras: every notebook with that set imports all it imports, with the other
    extras' modules hidden."""
    group = [py for py in NOTEBOOKS if notebook_imports(py)[0] == extras]
    hidden = {m for extra, modules in sync_notebooks.EXTRA_MODULES.items() if extra not in extras for m in modules}
    modules = sorted({m for py in group for m in notebook_imports(py)[1]})
    run = import_without(hidden, modules)
    assert run.returncode == 0, f"{[py.stem for py in group]} without {sorted(hidden)}: {run.stderr[-2000:]}"


def test_make_and_conda_install_every_extra() -> None:
    """`make study` / `make test` (scripts/setup.sh) and environment.yml install the whole of kvlab."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
                 ["project"]["optional-dependencies"])
    for path in (REPO / "scripts" / "setup.sh", REPO / "environment.yml"):
        installed = re.findall(r"-e \"?\.\[([\w,]+)\]", path.read_text(encoding="utf-8"))
        assert installed and set(installed[0].split(",")) == extras, f"{path.name} installs {installed}, not {extras}"


def test_a_feature_whose_extra_is_missing_says_which_extra_to_install() -> None:
    code = """
import importlib
from kvlab.errors import MissingExtraError
from kvlab.engine.config import load_model_config
from kvlab.engine.weights import check_checkpoint
from kvlab.sizing.hf_config import read_model_shape
calls = [lambda: read_model_shape("no-such-dir"), lambda: load_model_config("no-such-dir"),
         lambda: check_checkpoint([], None, {}), lambda: importlib.import_module("kvlab.studies.dask_client")]
for call in calls:
    try:
        call()
    except MissingExtraError as e:
        print(e)
"""
    hidden = {m for modules in sync_notebooks.EXTRA_MODULES.values() for m in modules}
    run = run_without(hidden, code)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 4, run.stdout
    for line, extra in zip(lines, ["engine", "engine", "engine", "dask"]):
        assert f"from kvlab's '{extra}' extra: pip install 'kvlab[{extra}]'" in line, line
