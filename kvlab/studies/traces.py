"""Request traces as pandas DataFrames, and the token ids a replay feeds to the block manager.

Every loader returns the same normalised columns, one row per request, in file order (sessions: in arrival
order):

    timestamp      float64  arrival time in ms (Mooncake: as in the file, ms from the trace start;
                            Azure: ms since the file's first request)
    input_length   int64    prompt tokens (Mooncake ``input_length``, Azure ``ContextTokens``)
    output_length  int64    generated tokens (Mooncake ``output_length``, Azure ``GeneratedTokens``)
    hash_ids       object   Mooncake: int64 array, one id per 512-token prompt block; Azure: None

Synthetic workloads (``kvlab.studies.synthetic``) add a ``token_ids`` column of explicit int64 arrays.

Agentic coding sessions (kv-cache-tester's Claude Code traces, ``read_sessions``) add:

    hash_id_tokens int64    tokens per hash id (the file's ``block_size``, 64); absent or NaN means 512
    session        object   the session's ``id`` (its file name in kv-cache-tester, e.g. "trace_0039")
    agent          object   "main" for the session's own requests, else the sub-agent's ``agent_id``
    think_time_ms  float64  client delay before the request (NaN where the file has none)
    api_time_ms    float64  the recorded server time of the request (NaN where the file has none)

Every session starts at time 0 (the traces are anonymised: no absolute times), so rows are sorted by arrival
time across sessions, as if all sessions ran at once.

Prefix sharing: a Mooncake id stands for "this whole prefix up to the end of this 512-token block", so
expanding id h into the 512 distinct tokens ``h * 512 + j`` gives prompts that share exactly the prefixes
the trace says, at any block size. Azure traces carry no content, so each Azure request gets its own
private token range: Azure requests share nothing and never hit the prefix cache. Session traces say the same
with 64-token ids (``hash_id_tokens``); their ids are local to a session, so the loader shifts each session's
ids past the previous session's, and gives the prompt's tail after its last full 64-token block (which the
file leaves without an id) a fresh id: the tail is never shared, which only a full-block cache ignores anyway.
A request without ``hash_ids`` (content unknown) gets fresh ids for all its blocks: it shares nothing.

Bundled traces are found by short name in the repository's ``data/`` directory (the ``KVLAB_DATA``
environment variable points elsewhere); anything else is read as a path: ``.jsonl`` files in the Mooncake
shape, ``.csv`` files in the Azure shape, ``.json`` files (one kv-cache-tester session) and ``.sessions.jsonl``
or ``.sessions.jsonl.xz`` files (one session per line), UTF-8 with or without a byte-order mark. A malformed record (bad
UTF-8, a missing or out-of-range field, a non-finite number) raises ``TraceFormatError`` naming the file and
the 1-based line number. A request holds at most ``MAX_REQUEST_TOKENS`` tokens, prompt and output together.
"""

import csv
import json
import lzma
import os
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.errors import InvalidArgumentError, TraceFormatError
from kvlab.validation import check_int, check_number, check_optional_int

BUNDLED = {
    "mooncake_conversation": "mooncake_conversation_trace.jsonl",
    "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "agentic_coding": "kv_cache_tester_agentic.sessions.jsonl.xz",
}
COLUMNS = ["timestamp", "input_length", "output_length", "hash_ids"]
SESSION_COLUMNS = [*COLUMNS, "hash_id_tokens", "session", "agent", "think_time_ms", "api_time_ms"]
SESSION_SUFFIXES = (".sessions.jsonl", ".sessions.jsonl.xz", ".json")
MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# Token-id ranges, chosen disjoint so different sources can never collide by accident:
# Mooncake ids * 512 stay below 2**40 (ids < 2**31); private ranges start at 2**40, 2**24 tokens each.
MAX_HASH_ID = 2**31 - 1
PRIVATE_TOKEN_BASE = 2**40
PRIVATE_RANGE = 2**24
#: A request's prompt and generated tokens together fit its private range (generated tokens get private ids).
MAX_REQUEST_TOKENS = PRIVATE_RANGE


def data_dir() -> Path:
    """Where bundled traces live: ``$KVLAB_DATA`` if set, else ``data/`` at the repository root."""
    env = os.environ.get("KVLAB_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data"  # kvlab/studies/traces.py -> repo root


def trace_path(trace: str | os.PathLike) -> Path:
    """A bundled trace's file by short name, or ``trace`` itself as a path."""
    if isinstance(trace, str) and trace in BUNDLED:
        path = data_dir() / BUNDLED[trace]
        if not path.is_file():
            raise InvalidArgumentError(f"bundled trace {trace!r} is missing: no file {path} "
                                       "(KVLAB_DATA, if set, names the directory that holds the traces)")
        return path
    if not isinstance(trace, (str, os.PathLike)):
        raise InvalidArgumentError(f"a trace is a bundled name or a path, got {type(trace).__name__}")
    path = Path(trace)
    if not path.is_file():
        raise InvalidArgumentError(f"trace {str(trace)!r} is neither a bundled trace name "
                                   f"({', '.join(BUNDLED)}) nor an existing file")
    return path


def load_trace(trace: str | os.PathLike, limit: int | None = None) -> pd.DataFrame:
    """Load a trace (short name or path) as a DataFrame with the normalised columns; ``limit`` keeps the
    first N requests (and stops reading there; sessions are all read, then cut in arrival order)."""
    limit = check_optional_int("limit", limit, 1)
    path = trace_path(trace)
    if path.name.endswith(SESSION_SUFFIXES):
        reader = read_sessions
    elif path.suffix in (".jsonl", ".csv"):
        reader = read_mooncake if path.suffix == ".jsonl" else read_azure
    else:
        raise InvalidArgumentError(f"{path}: unknown trace format; expected .jsonl (Mooncake), .csv (Azure), "
                                   ".json or .sessions.jsonl[.xz] (kv-cache-tester sessions)")
    try:
        return reader(path, limit)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read trace {path}: {e.strerror or e}") from None


def _open_text(path: Path):
    # utf-8-sig drops a leading byte-order mark; surrogateescape defers undecodable bytes to _check_utf8,
    # which can then name their line. An .xz file is read through lzma, as text the same way.
    opener = lzma.open if path.suffix == ".xz" else open
    return opener(path, "rt", encoding="utf-8-sig", errors="surrogateescape", newline="")


def _check_utf8(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TraceFormatError(f"{where}: not valid UTF-8") from None


def _field(where: str, check, name: str, value, *bounds):
    """``check(name, value, *bounds)`` (a ``kvlab.validation`` checker), failing as a TraceFormatError."""
    try:
        return check(name, value, *bounds)
    except InvalidArgumentError as e:
        raise TraceFormatError(f"{where}: {e}") from None


def _lengths(where: str, names: tuple[str, str], input_length, output_length) -> tuple[int, int]:
    input_length = _field(where, check_int, names[0], input_length, 1, MAX_REQUEST_TOKENS)
    output_length = _field(where, check_int, names[1], output_length, 0, MAX_REQUEST_TOKENS)
    if input_length + output_length > MAX_REQUEST_TOKENS:
        raise TraceFormatError(f"{where}: {names[0]} + {names[1]} = {input_length + output_length} tokens; a "
                               f"request holds at most {MAX_REQUEST_TOKENS}")
    return input_length, output_length


def read_mooncake(path: Path, limit: int | None = None) -> pd.DataFrame:
    """Mooncake JSONL: one object per line with timestamp, input_length, output_length, hash_ids."""
    rows = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            _check_utf8(line, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # also a 5,000-digit number, or arrays nested 10^5 deep
                raise TraceFormatError(f"{where}: not valid JSON ({getattr(e, 'msg', None) or e})") from None
            if not isinstance(record, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
            # json accepts NaN and Infinity; check_number refuses them.
            timestamp = _field(where, check_number, "'timestamp' (ms)", record.get("timestamp"), 0)
            input_length, output_length = _lengths(where, ("'input_length'", "'output_length'"),
                                                   record.get("input_length"), record.get("output_length"))
            hash_ids = record.get("hash_ids")
            # JSON gives plain ints (never NumPy's), and bool is not an int here: the exact type test is both
            # right and fast, which matters at ~300k ids per trace.
            if (not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids)
                    or (hash_ids and not 0 <= min(hash_ids) <= max(hash_ids) <= MAX_HASH_ID)):
                raise TraceFormatError(f"{where}: 'hash_ids' must be a list of ints in [0, {MAX_HASH_ID}]")
            expected = -(-input_length // MOONCAKE_BLOCK_TOKENS)
            if len(hash_ids) != expected:
                raise TraceFormatError(f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; "
                                       f"expected one per {MOONCAKE_BLOCK_TOKENS}-token block ({expected})")
            rows.append((timestamp, input_length, output_length, np.array(hash_ids, dtype=np.int64)))
            if len(rows) == limit:
                break
    return _frame(rows, path)


def read_azure(path: Path, limit: int | None = None) -> pd.DataFrame:
    """Azure CSV: a header with TIMESTAMP, ContextTokens, GeneratedTokens (other columns are ignored)."""
    rows, stamps, line_nos = [], [], []
    with _open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            _check_utf8(",".join(header or ()), f"{path}:1")
            if header is None or not set(AZURE_COLUMNS) <= set(header):
                raise TraceFormatError(f"{path}:1: header must contain {', '.join(AZURE_COLUMNS)}, got {header}")
            t_col, in_col, out_col = (header.index(c) for c in AZURE_COLUMNS)
            for row in reader:
                where = f"{path}:{reader.line_num}"
                _check_utf8(",".join(row), where)
                if not row:
                    continue
                if len(row) != len(header):
                    raise TraceFormatError(f"{where}: {len(row)} fields, the header has {len(header)}")
                try:
                    lengths = int(row[in_col]), int(row[out_col])
                except ValueError:
                    raise TraceFormatError(f"{where}: ContextTokens and GeneratedTokens must be integers, "
                                           f"got {row[in_col]!r}, {row[out_col]!r}") from None
                rows.append((0.0, *_lengths(where, ("ContextTokens", "GeneratedTokens"), *lengths), None))
                stamps.append(row[t_col])
                line_nos.append(reader.line_num)
                if len(rows) == limit:
                    break
        except csv.Error as e:  # a NUL byte, an unterminated quote, a field over csv's size limit
            raise TraceFormatError(f"{path}:{reader.line_num}: not a valid CSV row ({e})") from None
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


def read_sessions(path: Path, limit: int | None = None) -> pd.DataFrame:
    """kv-cache-tester sessions (https://github.com/callanjfox/kv-cache-tester, ``traces/*.json``): a ``.json``
    file holds one session, a ``.sessions.jsonl`` file (``.xz``-compressed or not) one per line. A session is
    an object with ``id``, ``block_size`` (tokens per hash id) and ``requests``; a request has ``t`` (seconds
    from the session's start), ``in``, ``out``, ``hash_ids`` (one per full block: ``in // block_size`` of
    them), optionally ``think_time`` and ``api_time`` (seconds); a ``{"type": "subagent", "agent_id": ...,
    "t": ..., "requests": [...]}`` entry holds a sub-agent's requests, their ``t`` counted from its own ``t``.
    ``limit`` keeps the first N requests in arrival order (every session is read)."""
    rows, next_id = [], 0
    try:
        if path.suffix == ".json":
            with _open_text(path) as f:
                text = f.read()
            _check_utf8(text, str(path))
            rows, next_id = _session_rows(str(path), _json_object(str(path), text), next_id)
        else:
            with _open_text(path) as f:
                for line_no, line in enumerate(f, start=1):
                    where = f"{path}:{line_no}"
                    _check_utf8(line, where)
                    if line.strip():
                        session_rows, next_id = _session_rows(where, _json_object(where, line), next_id)
                        rows += session_rows
    except (lzma.LZMAError, EOFError) as e:  # a corrupt or truncated .xz file
        raise TraceFormatError(f"{path}: not a valid xz file ({e})") from None
    frame = _frame(rows, path, SESSION_COLUMNS)
    frame = frame.sort_values("timestamp", kind="stable", ignore_index=True)
    return frame.head(limit) if limit else frame


def _json_object(where: str, text: str) -> dict:
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:  # also a 5,000-digit number, or arrays nested 10^5 deep
        raise TraceFormatError(f"{where}: not valid JSON ({getattr(e, 'msg', None) or e})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _session_rows(where: str, session: dict, first_id: int) -> tuple[list, int]:
    """One session's rows, its hash ids shifted to start at ``first_id``; and the next unused id."""
    name = session.get("id")
    if not isinstance(name, str):
        raise TraceFormatError(f"{where}: a session needs a string 'id', got {name!r}")
    where = f"{where}: session {name!r}"
    id_tokens = _field(where, check_int, "'block_size'", session.get("block_size"), 1, MOONCAKE_BLOCK_TOKENS)
    requests = list(_session_requests(where, session.get("requests"), "requests", "main", 0.0))
    known = [r[4] for r in requests if r[4] is not None and len(r[4])]
    fresh = first_id + (max(int(ids.max()) for ids in known) + 1 if known else 0)  # past every id of the file
    rows = []
    for timestamp, input_length, output_length, agent, ids, think, api, here in requests:
        if ids is not None and len(ids) != input_length // id_tokens:
            raise TraceFormatError(f"{here}: {len(ids)} hash_ids for 'in' {input_length}; expected one per full "
                                   f"{id_tokens}-token block ({input_length // id_tokens})")
        blocks = -(-input_length // id_tokens)
        local = ids if ids is not None else np.empty(0, dtype=np.int64)  # content unknown: all blocks fresh
        tail = np.arange(fresh, fresh + blocks - len(local), dtype=np.int64)
        fresh += len(tail)
        rows.append((timestamp, input_length, output_length, np.concatenate([local + first_id, tail]),
                     id_tokens, name, agent, think, api))
    if fresh - 1 > MAX_HASH_ID:
        raise TraceFormatError(f"{where}: the sessions need {fresh} distinct hash ids; at most {MAX_HASH_ID + 1} fit")
    return rows, fresh


def _session_requests(where: str, requests, label: str, agent: str, start_s: float):
    """``(timestamp ms, in, out, agent, local hash ids or None, think ms, api ms, where)`` per request,
    sub-agents' included, in file order."""
    if not isinstance(requests, list):
        raise TraceFormatError(f"{where}: '{label}' must be a list of requests")
    for k, request in enumerate(requests):
        here = f"{where}, {label}[{k}]"
        if not isinstance(request, dict):
            raise TraceFormatError(f"{here}: expected a JSON object, got {type(request).__name__}")
        t = start_s + _field(here, check_number, "'t' (s)", request.get("t"), 0)
        if request.get("type") == "subagent":
            agent_id = request.get("agent_id")
            if not isinstance(agent_id, str) or agent_id == "main":
                raise TraceFormatError(f"{here}: a sub-agent needs a string 'agent_id' other than 'main', "
                                       f"got {agent_id!r}")
            yield from _session_requests(where, request.get("requests"), f"{label}[{k}].requests", agent_id, t)
            continue
        input_length, output_length = _lengths(here, ("'in'", "'out'"), request.get("in"), request.get("out"))
        ids = request.get("hash_ids")
        if ids is not None:
            if (not isinstance(ids, list) or not all(type(h) is int for h in ids)
                    or (ids and not 0 <= min(ids) <= max(ids) <= MAX_HASH_ID)):
                raise TraceFormatError(f"{here}: 'hash_ids' must be a list of ints in [0, {MAX_HASH_ID}]")
            ids = np.array(ids, dtype=np.int64)
        times = [_field(here, check_number, f"'{key}' (s)", request[key], 0) * 1000.0 if key in request
                 else np.nan for key in ("think_time", "api_time")]
        yield t * 1000.0, input_length, output_length, agent, ids, *times, here


def _frame(rows: list, path: Path, columns: list = COLUMNS) -> pd.DataFrame:
    if not rows:
        raise TraceFormatError(f"{path}: no requests in the file")
    frame = pd.DataFrame(rows, columns=columns)
    types = {"timestamp": "float64", "input_length": "int64", "output_length": "int64", "hash_id_tokens": "int64",
             "think_time_ms": "float64", "api_time_ms": "float64"}
    return frame.astype({column: kind for column, kind in types.items() if column in frame})


def check_frame(frame, *, timestamps: bool = True) -> pd.DataFrame:
    """``frame`` if it is a non-empty trace DataFrame whose lengths (and, with ``timestamps``, arrival times)
    a loader would accept; else InvalidArgumentError naming the column and the first bad row (0-based
    position). For traces built in Python, which skip the loaders' checks."""
    needed = (["timestamp"] if timestamps else []) + ["input_length", "output_length"]
    if not isinstance(frame, pd.DataFrame) or not set(needed) <= set(frame.columns) or frame.empty:
        raise InvalidArgumentError(f"a trace must be a non-empty DataFrame with columns {', '.join(needed)} "
                                   "(the columns of kvlab.studies.traces.load_trace)")
    for column, minimum in (("input_length", 1), ("output_length", 0)):
        values = frame[column]
        if not pd.api.types.is_integer_dtype(values.dtype):
            raise InvalidArgumentError(f"trace column {column} must hold ints, got dtype {values.dtype}")
        inside = values.between(minimum, MAX_REQUEST_TOKENS).fillna(False).to_numpy(dtype=bool)
        _refuse(values, ~inside, f"ints in [{minimum}, {MAX_REQUEST_TOKENS}]")
    total = frame["input_length"].to_numpy(np.int64) + frame["output_length"].to_numpy(np.int64)
    _refuse(pd.Series(total, name="input_length + output_length"), total > MAX_REQUEST_TOKENS,
            f"at most {MAX_REQUEST_TOKENS} tokens")
    if "token_ids" in frame:  # explicit prompts (synthetic workloads) must be as long as the lengths say
        explicit = frame["token_ids"].notna().to_numpy()
        sizes = frame["token_ids"][explicit].map(len).to_numpy(np.int64)
        _refuse(frame["input_length"][explicit], sizes != frame["input_length"][explicit].to_numpy(),
                "the lengths of the token_ids column")
    if timestamps:
        values = frame["timestamp"]
        if not pd.api.types.is_numeric_dtype(values.dtype) or pd.api.types.is_bool_dtype(values.dtype):
            raise InvalidArgumentError(f"trace column timestamp must hold numbers of ms, got dtype {values.dtype}")
        # NaN or infinite arrival times would stall the overlap replay's clock.
        _refuse(values, ~np.isfinite(values.to_numpy(dtype=np.float64, na_value=np.nan)), "finite numbers of ms")
    return frame


def _refuse(values: pd.Series, bad: np.ndarray, allowed: str) -> None:
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InvalidArgumentError(f"trace column {values.name} must hold {allowed}; row {row} has "
                                   f"{values.iloc[row]}")


def mooncake_token_ids(hash_ids, input_length: int, id_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """Prompt token ids of a request with hash ids of ``id_tokens`` tokens each (Mooncake: 512): id h becomes
    tokens h*id_tokens .. h*id_tokens+id_tokens-1, truncated to ``input_length`` (the last block may be
    partial). Built without Python loops."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    id_tokens = check_int("id_tokens", id_tokens, 1, MOONCAKE_BLOCK_TOKENS)  # so that ids * id_tokens < 2**40
    if ids.ndim != 1 or not 0 < input_length <= ids.size * id_tokens:
        raise InvalidArgumentError(f"input_length {input_length} does not fit {ids.size} hash ids of "
                                   f"{id_tokens} tokens")
    tokens = ids[:, None] * id_tokens + np.arange(id_tokens, dtype=np.int64)
    return tokens.ravel()[:input_length]


def hash_id_tokens(trace: pd.DataFrame) -> np.ndarray:
    """Tokens per hash id of each row: the ``hash_id_tokens`` column where set, else Mooncake's 512."""
    if "hash_id_tokens" not in trace:
        return np.full(len(trace), MOONCAKE_BLOCK_TOKENS, dtype=np.int64)
    return trace["hash_id_tokens"].fillna(MOONCAKE_BLOCK_TOKENS).to_numpy(np.int64)


def private_token_ids(request_index: int, length: int) -> np.ndarray:
    """``length`` token ids that no other request index uses: for traces without content (Azure) and for
    generated tokens, which the traces do not record."""
    if not 0 <= length <= PRIVATE_RANGE:
        raise InvalidArgumentError(f"a private token range holds at most {PRIVATE_RANGE} tokens, got {length}")
    return PRIVATE_TOKEN_BASE + request_index * PRIVATE_RANGE + np.arange(length, dtype=np.int64)


class PromptTokens:
    """``prompts[i]``: request i's prompt token ids (int64 array), built on demand so that a 10^5-request
    trace never holds all its tokens at once. Explicit ``token_ids`` win, then ``hash_ids`` (of
    ``hash_id_tokens`` tokens each), else a private range (no sharing)."""

    def __init__(self, trace: pd.DataFrame):
        n = len(trace)
        self._lengths = trace["input_length"].to_numpy()
        self._explicit = trace["token_ids"].tolist() if "token_ids" in trace else [None] * n
        self._hash_ids = trace["hash_ids"].tolist() if "hash_ids" in trace else [None] * n
        self._id_tokens = hash_id_tokens(trace)

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if self._explicit[i] is not None:
            return np.asarray(self._explicit[i], dtype=np.int64)
        if self._hash_ids[i] is not None:
            return mooncake_token_ids(self._hash_ids[i], int(self._lengths[i]), int(self._id_tokens[i]))
        return private_token_ids(i, int(self._lengths[i]))
