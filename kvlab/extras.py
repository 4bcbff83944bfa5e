"""kvlab's optional dependencies: a core install (`pip install kvlab`) has the block manager, the kernels and the
studies; serving models needs the ``engine`` extra and Dask clusters the ``dask`` extra (pyproject.toml).

A module that needs one imports it where it is used, after ``require``, so ``import kvlab`` and every core
module work without it, and a missing extra is one clear error instead of a ``ModuleNotFoundError``.
"""

import importlib

from kvlab.errors import MissingExtraError


def require(modules: tuple[str, ...], extra: str, feature: str) -> None:
    """Import every top-level module in ``modules`` (the caller is about to), raising MissingExtraError if one is
    not installed. ``feature`` says what needs them, e.g. "reading a model's weights"."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module is there but one of its own dependencies is not: not ours to name
                raise
            missing.append(name)
    if missing:
        raise MissingExtraError(f"{feature} needs {', '.join(missing)}, from kvlab's '{extra}' extra: "
                                f"pip install 'kvlab[{extra}]' (in a checkout: pip install -e '.[{extra}]'; "
                                f"`make setup` installs every extra)")
