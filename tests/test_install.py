"""The install that scripts/setup.sh makes: kvlab imports wherever a script runs from."""

import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def test_a_script_beside_a_checkout_named_kvlab_imports_the_package(tmp_path):
    # A clone named `kvlab` has no __init__.py at its top, so from its parent folder Python's own search
    # finds it first and, with an import-hook editable install, makes it an empty namespace package.
    (tmp_path / "kvlab").symlink_to(CHECKOUT, target_is_directory=True)
    done = subprocess.run([sys.executable, "-c", "from kvlab import BlockManager; print(BlockManager.__module__)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kvlab.blocks.manager"
