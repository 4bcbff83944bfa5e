"""The bundled traces in data/ are the published files: their SHA-256 match data/README.md."""

import hashlib
import re
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"


def documented_checksums() -> dict[str, str]:
    """File name -> SHA-256 from the `sha256sum`-style block in data/README.md."""
    text = (DATA / "README.md").read_text(encoding="utf-8")
    return {name: digest for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", text, flags=re.M)}


CHECKSUMS = documented_checksums()


def test_readme_lists_every_trace() -> None:
    traces = sorted(path.name for path in DATA.iterdir() if path.suffix in {".jsonl", ".csv", ".xz"})
    assert traces, "data/ holds no traces"
    assert sorted(CHECKSUMS) == traces


@pytest.mark.parametrize("name", sorted(CHECKSUMS))
def test_trace_matches_its_checksum(name: str) -> None:
    digest = hashlib.sha256((DATA / name).read_bytes()).hexdigest()
    assert digest == CHECKSUMS[name], (
        f"data/{name} differs from the published file (edited, truncated, or line endings converted?)"
    )
