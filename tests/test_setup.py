"""The bundled traces in data/ are the published files: their SHA-256 match data/README.md."""

import hashlib
import json
import lzma
import random
import re
from pathlib import Path

import pytest
from repo_scripts import load_script

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


def test_the_agentic_cut_is_the_stated_sample_copied_byte_for_byte(tmp_path, capsys) -> None:
    """scripts/cut_agentic_traces.py on a made-up checkout: the seeded sample of the files under the size cap,
    in name order, one unmodified file per line."""
    cut = load_script("cut_agentic_traces")
    traces = tmp_path / "traces"
    traces.mkdir()
    for i in range(cut.SESSIONS + 5):
        request = {"t": 0, "in": 64, "out": 1, "hash_ids": [i]}
        session = {"id": f"trace_{i:04d}", "block_size": 64, "requests": [request]}
        (traces / f"trace_{i:04d}.json").write_text(json.dumps(session))
    (traces / "trace_9999.json").write_text("x" * (cut.MAX_SESSION_BYTES + 1))  # over the cap: never chosen
    cut.main(str(tmp_path), str(tmp_path / "out.sessions.jsonl.xz"))
    candidates = sorted(p for p in traces.glob("trace_*.json") if p.name != "trace_9999.json")
    chosen = sorted(random.Random(cut.SEED).sample(candidates, cut.SESSIONS))
    written = lzma.decompress((tmp_path / "out.sessions.jsonl.xz").read_bytes())
    assert written == b"".join(p.read_bytes() + b"\n" for p in chosen)
    counts = f"{cut.SESSIONS} sessions, {cut.SESSIONS} requests (0 sub-agents), 0 without hash_ids"
    assert counts in capsys.readouterr().out
