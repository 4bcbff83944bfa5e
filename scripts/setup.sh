#!/usr/bin/env bash
# Installs kvlab and its dependencies into the project virtualenv .venv.
#
# Idempotent: a stamp in .venv holds the hash of pyproject.toml and this script; when neither changed
# a re-run returns at once. An existing .venv with Python >= 3.10 is reused, never rebuilt.
#
# torch: a torch the venv can already import (e.g. Colab's, visible through --system-site-packages)
# is kept as is. Otherwise: CUDA build when nvidia-smi works, else the CPU build pinned with a "+cpu"
# local version so that no CUDA wheel can ever be chosen.
#
# Environment overrides:
#   PYTHON                 interpreter that creates .venv (default: python3, needs >= 3.10)
#   KVLAB_TORCH_CPU_SPEC   CPU torch requirement (default: torch==2.13.0+cpu)
#   KVLAB_TORCH_CPU_INDEX  extra index holding it if pip's own sources do not (default: PyTorch's CPU index)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=.venv
py=$venv/bin/python
stamp=$venv/.kvlab-setup-stamp
torch_cpu_spec=${KVLAB_TORCH_CPU_SPEC:-torch==2.13.0+cpu}
torch_cpu_index=${KVLAB_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -x $py && -f $stamp && $(<"$stamp") == "$want" ]]; then
    exit 0
fi

say() { printf '==> %s\n' "$*"; }
pip_install() { "$py" -m pip install "$@"; }
is_py310() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; }

if ! is_py310 "$py"; then
    base=${PYTHON:-python3}
    if ! is_py310 "$base"; then
        echo "error: kvlab needs Python >= 3.10 and '$base' is missing or older; rerun with PYTHON=/path/to/python3.X" >&2
        exit 1
    fi
    say "Creating $venv with $("$base" --version 2>&1) (it sees system packages, so an installed torch is reused)"
    if ! "$base" -m venv --clear --system-site-packages "$venv"; then
        echo "error: '$base -m venv' failed; on Debian/Ubuntu install the python3-venv package" >&2
        exit 1
    fi
fi

if "$py" -c 'import torch' 2>/dev/null; then
    say "Keeping the installed torch $("$py" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
    say "GPU found: installing torch with CUDA"
    pip_install torch
else
    say "No GPU: installing the CPU build of torch ($torch_cpu_spec)"
    # pip's configured sources first: free when they hold the wheel (a local find-links or mirror), and
    # PyPI, which never has "+cpu" builds, says so within a second. The PyTorch index is added only when
    # needed because an unreachable extra index costs every pip call ~8 s of retries (measured) or
    # minutes when DNS hangs. A pip too old for --dry-run simply takes the second branch.
    if "$py" -m pip install --dry-run --no-deps -q "$torch_cpu_spec" >/dev/null 2>&1; then
        pip_install "$torch_cpu_spec"
    else
        say "Not in pip's configured sources; fetching it from $torch_cpu_index"
        pip_install "$torch_cpu_spec" --extra-index-url "$torch_cpu_index"
    fi
fi

say "Installing kvlab (editable) with every extra and its test and notebook tools"
# compat mode puts the checkout itself on sys.path (a .pth line) instead of an import hook that runs
# after Python's own search: then a script run from the folder holding a checkout named `kvlab` still
# imports the package, not that folder as an empty namespace package ("unknown location").
pip_install -e ".[engine,dask,dev]" --config-settings editable_mode=compat

echo "$want" >"$stamp"
say "Setup done: $venv is ready"
