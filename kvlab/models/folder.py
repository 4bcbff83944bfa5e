"""What counts as a servable Hugging Face model folder, and the cache folder a converted model lives in.

A converted folder is published by renaming a finished temporary folder into place (atomic on one file
system), and it holds a manifest written last, naming the source and every file with its size. A folder
whose manifest is missing, names another source, or lists a file that is gone or has another size (a copy
cut short, a file deleted by hand) is never used: the caller converts again and replaces it.
"""

import json
import os
import shutil
import uuid
from pathlib import Path

from kvlab.models.errors import ModelFolderError

MANIFEST = "kvlab-manifest.json"


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def check_model_folder(path, what: str) -> Path:
    """``path`` as a Path if it holds config.json and *.safetensors; ``what`` names where it came from."""
    folder = Path(path).expanduser()
    if not is_model_folder(folder):
        raise ModelFolderError(f"{what} = {str(path)!r} is not a Hugging Face model folder (it needs config.json "
                               "and *.safetensors weights, e.g. a snapshot of HuggingFaceTB/SmolLM2-135M-Instruct)")
    return folder


def cache_root(cache_dir=None) -> Path:
    """``cache_dir``, else $KVLAB_CACHE, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("KVLAB_CACHE"):
        return Path(os.environ["KVLAB_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvlab"


def write_manifest(folder: Path, source: dict, about: dict) -> None:
    """Record ``source`` (what identifies the conversion), ``about`` (for people: provenance, licences,
    versions) and every file's size. Call it last, once everything else is written."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {"source": source, "about": about, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def is_complete(folder: Path, source: dict) -> bool:
    """Whether ``folder`` holds a finished conversion of ``source`` (see the module docstring)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        return manifest["source"] == source and all((folder / name).stat().st_size == size
                                                    for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def publish(staged: Path, final: Path, source: dict) -> Path:
    """Move the finished folder ``staged`` to ``final``; returns ``final``. Two processes converting at once
    both get here: the first rename wins, and the other process uses the winner's folder and drops its own.
    An incomplete folder found at ``final`` is moved aside and deleted, then the rename is tried again."""
    for attempt in range(3):
        try:
            os.rename(staged, final)  # refuses to replace a non-empty folder
            return final
        except OSError:
            if is_complete(final, source):
                shutil.rmtree(staged, ignore_errors=True)
                return final
            if attempt == 2:  # something keeps writing there, or the rename itself is impossible
                raise
        aside = final.with_name(f".{final.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(final, aside)
        except FileNotFoundError:  # another process moved it aside first
            continue
        shutil.rmtree(aside, ignore_errors=True)
