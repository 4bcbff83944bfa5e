"""Re-cut the bundled agentic-coding subset (data/kv_cache_tester_agentic.sessions.jsonl.xz) from a checkout of
https://github.com/callanjfox/kv-cache-tester (Apache-2.0; its traces/ holds one JSON file per Claude Code session).

The rule, so that anyone with a checkout gets the same sessions: among traces/trace_*.json files of at most
MAX_SESSION_BYTES (the cap keeps the bundle small; it leaves out the longest sessions), sorted by name, take
random.Random(SEED).sample(..., SESSIONS), then write them in name order, one session per line, each line
byte-identical to its source file (the files are single-line JSON without a final newline), xz-compressed.
Nothing inside a session is changed: requests without ``hash_ids`` would be kept and are reported here (the
loader gives them prompts that share nothing); the subset cut at the recorded commit has none.

Usage: python scripts/cut_agentic_traces.py CHECKOUT [OUTPUT]   (OUTPUT defaults to the bundled file)
Prints each session's file, size and SHA-256, the counts, and the SHA-256 of the JSONL and of the .xz file;
data/README.md records them.
"""

import hashlib
import json
import lzma
import random
import sys
from pathlib import Path

SEED = 40                    # issue 40
SESSIONS = 40
MAX_SESSION_BYTES = 2_000_000
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "data" / "kv_cache_tester_agentic.sessions.jsonl.xz"


def choose(traces_dir: Path) -> list[Path]:
    candidates = sorted(p for p in traces_dir.glob("trace_*.json") if p.stat().st_size <= MAX_SESSION_BYTES)
    if len(candidates) < SESSIONS:
        sys.exit(f"{traces_dir}: only {len(candidates)} session files of at most {MAX_SESSION_BYTES} bytes")
    return sorted(random.Random(SEED).sample(candidates, SESSIONS))


def requests_of(session: dict):
    """Every request, sub-agents' included (a sub-agent is a {"type": "subagent", "requests": [...]} entry)."""
    for request in session["requests"]:
        if request.get("type") == "subagent":
            yield from requests_of(request)
        else:
            yield request


def main(checkout: str, output: str | None = None) -> None:
    chosen = choose(Path(checkout) / "traces")
    lines, requests, without_hash_ids, subagents = [], 0, 0, 0
    for path in chosen:
        raw = path.read_bytes()
        if b"\n" in raw.rstrip(b"\n"):
            sys.exit(f"{path}: not a single-line JSON file; the bundle keeps one session per line")
        session = json.loads(raw)
        subagents += sum(r.get("type") == "subagent" for r in session["requests"])
        for request in requests_of(session):
            requests += 1
            without_hash_ids += "hash_ids" not in request
        lines.append(raw.rstrip(b"\n") + b"\n")
        print(f"{path.name}  {len(raw):>9,} bytes  sha256 {hashlib.sha256(raw).hexdigest()}")
    jsonl = b"".join(lines)
    out = Path(output) if output else DEFAULT_OUTPUT
    out.write_bytes(lzma.compress(jsonl, preset=9))
    print(f"{len(chosen)} sessions, {requests} requests ({subagents} sub-agents), {without_hash_ids} without hash_ids")
    print(f"{hashlib.sha256(jsonl).hexdigest()}  (the uncompressed JSONL, {len(jsonl):,} bytes)")
    print(f"{hashlib.sha256(out.read_bytes()).hexdigest()}  {out.name} ({out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
