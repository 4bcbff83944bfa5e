"""The repository's scripts/ as modules, for the tests that check what they generate (scripts/ is no package)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """scripts/NAME.py, imported as the module NAME."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
