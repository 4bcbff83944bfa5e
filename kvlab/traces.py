"""Request traces as pandas DataFrames, and the token ids a replay feeds to the block manager.

Every loader returns the same normalised columns, one row per request, in file order:

    timestamp      float64  arrival time in ms (Mooncake: as in the file, ms from the trace start;
                            Azure: ms since the file's first request)
    input_length   int64    prompt tokens (Mooncake ``input_length``, Azure ``ContextTokens``)
    output_length  int64    generated tokens (Mooncake ``output_length``, Azure ``GeneratedTokens``)
    hash_ids       object   Mooncake: int64 array, one id per 512-token prompt block; Azure: None

Synthetic workloads (``kvlab.studies.synthetic``) add a ``token_ids`` column of explicit int64 arrays.

Prefix sharing: a Mooncake id stands for "this whole prefix up to the end of this 512-token block", so
expanding id h into the 512 distinct tokens ``h * 512 + j`` gives prompts that share exactly the prefixes
the trace says, at any block size. Azure traces carry no content, so each Azure request gets its own
private token range: Azure requests share nothing and never hit the prefix cache.

Bundled traces are found by short name in the repository's ``data/`` directory (the ``KVLAB_DATA``
environment variable points elsewhere); anything else is read as a path: ``.jsonl`` files in the Mooncake
shape, ``.csv`` files in the Azure shape. A malformed record raises ``TraceFormatError`` naming the file
and the 1-based line number.
"""

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.errors import InvalidArgumentError, TraceFormatError

BUNDLED = {
    "mooncake_conversation": "mooncake_conversation_trace.jsonl",
    "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
}
COLUMNS = ["timestamp", "input_length", "output_length", "hash_ids"]
MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# Token-id ranges, chosen disjoint so different sources can never collide by accident:
# Mooncake ids * 512 stay below 2**40 (ids < 2**31); private ranges start at 2**40, 2**24 tokens each.
MAX_HASH_ID = 2**31 - 1
PRIVATE_TOKEN_BASE = 2**40
PRIVATE_RANGE = 2**24


def data_dir() -> Path:
    """Where bundled traces live: ``$KVLAB_DATA`` if set, else ``data/`` at the repository root."""
    env = os.environ.get("KVLAB_DATA")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data"


def trace_path(trace: str | os.PathLike) -> Path:
    """A bundled trace's file by short name, or ``trace`` itself as a path."""
    if isinstance(trace, str) and trace in BUNDLED:
        return data_dir() / BUNDLED[trace]
    if not isinstance(trace, (str, os.PathLike)):
        raise InvalidArgumentError(f"a trace is a bundled name or a path, got {type(trace).__name__}")
    path = Path(trace)
    if not path.is_file():
        raise InvalidArgumentError(f"trace {str(trace)!r} is neither a bundled trace name "
                                   f"({', '.join(BUNDLED)}) nor an existing file")
    return path


def load_trace(trace: str | os.PathLike, limit: int | None = None) -> pd.DataFrame:
    """Load a trace (short name or path) as a DataFrame with the normalised columns; ``limit`` keeps the
    first N requests (and stops reading there)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgumentError(f"limit must be a positive int or None, got {limit!r}")
    path = trace_path(trace)
    if path.suffix == ".jsonl":
        return read_mooncake(path, limit)
    if path.suffix == ".csv":
        return read_azure(path, limit)
    raise InvalidArgumentError(f"{path}: unknown trace format; expected .jsonl (Mooncake) or .csv (Azure)")


def _int_field(record: dict, key: str, minimum: int, where: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{where}: {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def read_mooncake(path: Path, limit: int | None = None) -> pd.DataFrame:
    """Mooncake JSONL: one object per line with timestamp, input_length, output_length, hash_ids."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
            timestamp = record.get("timestamp")
            if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not timestamp >= 0:
                raise TraceFormatError(f"{where}: 'timestamp' must be a number of ms >= 0, got {timestamp!r}")
            input_length = _int_field(record, "input_length", 1, where)
            output_length = _int_field(record, "output_length", 0, where)
            hash_ids = record.get("hash_ids")
            if not isinstance(hash_ids, list) or any(
                    isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID for h in hash_ids):
                raise TraceFormatError(f"{where}: 'hash_ids' must be a list of ints in [0, {MAX_HASH_ID}]")
            expected = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
            if len(hash_ids) != expected:
                raise TraceFormatError(f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; "
                                       f"expected one per {MOONCAKE_BLOCK_TOKENS}-token block ({expected})")
            rows.append((float(timestamp), input_length, output_length, np.array(hash_ids, dtype=np.int64)))
            if len(rows) == limit:
                break
    return _frame(rows, path)


def read_azure(path: Path, limit: int | None = None) -> pd.DataFrame:
    """Azure CSV: a header with TIMESTAMP, ContextTokens, GeneratedTokens (other columns are ignored)."""
    rows, stamps, line_nos = [], [], []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or not set(AZURE_COLUMNS) <= set(header):
            raise TraceFormatError(f"{path}:1: header must contain {', '.join(AZURE_COLUMNS)}, got {header}")
        t_col, in_col, out_col = (header.index(c) for c in AZURE_COLUMNS)
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row:
                continue
            if len(row) != len(header):
                raise TraceFormatError(f"{where}: {len(row)} fields, the header has {len(header)}")
            try:
                input_length, output_length = int(row[in_col]), int(row[out_col])
            except ValueError:
                raise TraceFormatError(f"{where}: ContextTokens and GeneratedTokens must be integers, "
                                       f"got {row[in_col]!r}, {row[out_col]!r}") from None
            if input_length < 1 or output_length < 0:
                raise TraceFormatError(f"{where}: need ContextTokens >= 1 and GeneratedTokens >= 0, "
                                       f"got {input_length}, {output_length}")
            rows.append((0.0, input_length, output_length, None))
            stamps.append(row[t_col])
            line_nos.append(reader.line_num)
            if len(rows) == limit:
                break
    # Parse the timestamps in one vectorised call; a failure is traced back to its line afterwards.
    times = pd.to_datetime(pd.Series(stamps, dtype=object), format="ISO8601", errors="coerce")
    bad = np.flatnonzero(times.isna().to_numpy())
    if bad.size:
        raise TraceFormatError(f"{path}:{line_nos[bad[0]]}: TIMESTAMP {stamps[bad[0]]!r} is not an "
                               "ISO-8601 date-time such as '2023-11-16 18:17:03.9799600'")
    frame = _frame(rows, path)
    if len(frame):
        frame["timestamp"] = (times - times.iloc[0]).dt.total_seconds().to_numpy() * 1000.0
    return frame


def _frame(rows: list, path: Path) -> pd.DataFrame:
    if not rows:
        raise TraceFormatError(f"{path}: no requests in the file")
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return frame.astype({"timestamp": "float64", "input_length": "int64", "output_length": "int64"})


def mooncake_token_ids(hash_ids, input_length: int) -> np.ndarray:
    """Prompt token ids of a Mooncake request: id h becomes tokens h*512 .. h*512+511, truncated to
    ``input_length`` (the last block may be partial). Built without Python loops."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.ndim != 1 or not 0 < input_length <= ids.size * MOONCAKE_BLOCK_TOKENS:
        raise InvalidArgumentError(f"input_length {input_length} does not fit {ids.size} hash ids of "
                                   f"{MOONCAKE_BLOCK_TOKENS} tokens")
    tokens = ids[:, None] * MOONCAKE_BLOCK_TOKENS + np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.int64)
    return tokens.ravel()[:input_length]


def private_token_ids(request_index: int, length: int) -> np.ndarray:
    """``length`` token ids that no other request index uses: for traces without content (Azure) and for
    generated tokens, which the traces do not record."""
    if not 0 <= length <= PRIVATE_RANGE:
        raise InvalidArgumentError(f"a private token range holds at most {PRIVATE_RANGE} tokens, got {length}")
    return PRIVATE_TOKEN_BASE + request_index * PRIVATE_RANGE + np.arange(length, dtype=np.int64)


class PromptTokens:
    """``prompts[i]``: request i's prompt token ids (int64 array), built on demand so that a 10^5-request
    trace never holds all its tokens at once. Explicit ``token_ids`` win, then Mooncake ``hash_ids``,
    else a private range (no sharing)."""

    def __init__(self, trace: pd.DataFrame):
        n = len(trace)
        self._lengths = trace["input_length"].to_numpy()
        self._explicit = trace["token_ids"].tolist() if "token_ids" in trace else [None] * n
        self._hash_ids = trace["hash_ids"].tolist() if "hash_ids" in trace else [None] * n

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if self._explicit[i] is not None:
            return np.asarray(self._explicit[i], dtype=np.int64)
        if self._hash_ids[i] is not None:
            return mooncake_token_ids(self._hash_ids[i], int(self._lengths[i]))
        return private_token_ids(i, int(self._lengths[i]))
