"""The Hugging Face Hub as a model source, tried so that a machine without access fails fast and quietly.

Three separate steps: a snapshot already in the local Hub cache (no network at all); a reachability probe
with a hard time limit (the probe runs in a daemon thread, so even a DNS lookup that hangs cannot hold the
caller longer than the limit); then the download itself. ``HF_HUB_OFFLINE=1`` skips the network steps.
"""

import os
import threading
from pathlib import Path

from kvlab.models.folder import is_model_folder

#: Enough to serve a model (config, tokenizer, chat template, weights) and nothing else from the repo.
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja"]
PROBE_TIMEOUT_S = 5.0


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def local_snapshot(repo: str) -> Path | None:
    """The repo's folder in the local Hub cache, if a complete snapshot is there."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo, allow_patterns=PATTERNS, local_files_only=True))
    except Exception:  # not cached (the exception type differs across huggingface_hub versions)
        return None
    return path if is_model_folder(path) else None


def reachable(repo: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the Hub answers for ``repo`` within ``timeout`` seconds."""
    from huggingface_hub import HfApi

    answered = threading.Event()

    def probe():
        try:
            HfApi().model_info(repo, timeout=timeout)
            answered.set()
        except Exception:  # no route, no DNS, no such repo, refused: all mean "not from here"
            pass

    threading.Thread(target=probe, daemon=True).start()
    return answered.wait(timeout)


def download(repo: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, allow_patterns=PATTERNS))
