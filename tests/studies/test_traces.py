"""Trace loaders: bundled traces, user files in the same shapes, malformed input, token-id expansion."""

import hashlib
import json
import lzma
import re

import numpy as np
import pandas as pd
import pytest

from kvlab.errors import InvalidArgumentError, TraceFormatError
from kvlab.studies.reuse import block_keys, consecutive_hit_rates
from kvlab.studies.traces import (BUNDLED, COLUMNS, MOONCAKE_BLOCK_TOKENS, SESSION_COLUMNS, PromptTokens, check_frame,
                                  data_dir, load_trace, mooncake_token_ids, private_token_ids, trace_path)

RECORDS = {"mooncake_conversation": 12_031, "mooncake_synthetic": 3_993, "azure_code": 8_819, "azure_conv": 19_366,
           "agentic_coding": 1_969}


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_traces_load_with_the_normalised_columns(name):
    trace = load_trace(name)
    assert list(trace.columns) == (SESSION_COLUMNS if name == "agentic_coding" else COLUMNS)
    assert len(trace) == RECORDS[name]
    assert (trace["input_length"] >= 1).all() and (trace["output_length"] >= 0).all()
    assert trace["timestamp"].iloc[0] == 0 and trace["timestamp"].is_monotonic_increasing
    if name == "agentic_coding":  # one id per 64-token block, the partial last one included
        assert (trace["hash_id_tokens"] == 64).all()
        assert (trace["hash_ids"].map(len) == -(-trace["input_length"] // 64)).all()
    elif name.startswith("mooncake"):
        blocks = trace["hash_ids"].map(len)
        assert (blocks == -(-trace["input_length"] // MOONCAKE_BLOCK_TOKENS)).all()
    else:
        assert trace["hash_ids"].isna().all()


def test_limit_keeps_the_first_requests():
    full, head = load_trace("azure_code"), load_trace("azure_code", limit=7)
    pd.testing.assert_frame_equal(head, full.head(7))


def test_azure_timestamps_are_ms_since_the_first_request(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Extra\n"
                    "2023-11-16 18:17:03.9799600,4808,10,x\n2023-11-16 18:17:05.4799600,31,0,y\n")
    trace = load_trace(path)
    assert trace["timestamp"].tolist() == pytest.approx([0.0, 1500.0])
    assert trace["input_length"].tolist() == [4808, 31] and trace["output_length"].tolist() == [10, 0]


def test_a_users_mooncake_file_loads_like_the_bundled_one(tmp_path):
    path = tmp_path / "mine.jsonl"
    records = [{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [7, 9]},
               {"timestamp": 8.5, "input_length": 10, "output_length": 0, "hash_ids": [7]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")  # a trailing blank line is fine
    trace = load_trace(str(path))
    assert list(trace.columns) == COLUMNS and trace["timestamp"].tolist() == [5.0, 8.5]
    assert [list(h) for h in trace["hash_ids"]] == [[7, 9], [7]]


GOOD_JSON = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
BAD_JSON_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 3}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 600.0, "output_length": 3, "hash_ids": [1, 2]}', "input_length"),
    ('{"timestamp": 0, "input_length": 600, "output_length": -2, "hash_ids": [1, 2]}', "output_length"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, "2"]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2, 3]}', "expected one per 512"),
]


@pytest.mark.parametrize("bad, what", BAD_JSON_LINES)
def test_a_malformed_jsonl_line_names_the_file_and_line(tmp_path, bad, what):
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{GOOD_JSON}\n\n{bad}\n{GOOD_JSON}\n")  # line 2 is blank: the bad record is line 3
    with pytest.raises(TraceFormatError, match=rf"broken\.jsonl:3: .*{what}"):
        load_trace(path)


GOOD_CSV = "2023-11-16 18:17:03.9799600,4808,10"
BAD_CSV_ROWS = [
    ("2023-11-16 18:17:04.0,12,x", "must be integers"),
    ("2023-11-16 18:17:04.0,0,5", r"ContextTokens must be an int in \[1, "),
    ("yesterday,12,5", "TIMESTAMP 'yesterday'"),
    ("2023-11-16 18:17:04.0,12", "2 fields"),
]


@pytest.mark.parametrize("bad, what", BAD_CSV_ROWS)
def test_a_malformed_csv_row_names_the_file_and_line(tmp_path, bad, what):
    path = tmp_path / "broken.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{GOOD_CSV}\n{GOOD_CSV}\n{bad}\n")
    with pytest.raises(TraceFormatError, match=rf"broken\.csv:4: .*{what}"):
        load_trace(path)


def test_a_csv_without_the_azure_header_is_rejected(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("time,prompt,output\n1,2,3\n")
    with pytest.raises(TraceFormatError, match=r"other\.csv:1: header must contain"):
        load_trace(path)


def test_unknown_names_formats_and_limits_are_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="neither a bundled trace"):
        load_trace("mooncake_convrsation")
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(InvalidArgumentError, match="unknown trace format"):
        load_trace(tmp_path / "t.txt")
    with pytest.raises(InvalidArgumentError, match="limit"):
        load_trace("azure_code", limit=0)


def test_hash_ids_expand_into_prefixes_shared_exactly_as_the_trace_says():
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 10_000, size=3)
    a = mooncake_token_ids(np.r_[shared, 20_001, 20_002], 5 * 512 - 37)
    b = mooncake_token_ids(np.r_[shared, 30_001], 4 * 512)
    assert a.dtype == np.int64 and len(a) == 5 * 512 - 37 and len(b) == 4 * 512
    assert len(np.unique(a)) == len(a)                 # 512 distinct ids per hash id, none repeated
    first_difference = np.flatnonzero(a[:len(b)] != b)[0]
    assert first_difference == 3 * 512                 # shared exactly the three common blocks
    assert a[512 * 2 + 5] == shared[2] * 512 + 5       # the documented formula


def test_hash_ids_must_cover_the_input_length():
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        mooncake_token_ids([1, 2], 2 * 512 + 1)


def test_azure_requests_share_nothing():
    prompts = PromptTokens(load_trace("azure_conv", limit=30))
    tokens = np.concatenate([prompts[i] for i in range(len(prompts))])
    assert len(np.unique(tokens)) == len(tokens)
    assert np.array_equal(prompts[3], private_token_ids(3, len(prompts[3])))


def test_explicit_token_ids_take_precedence_over_hash_ids():
    trace = pd.DataFrame({"timestamp": [0.0], "input_length": [3], "output_length": [1],
                          "hash_ids": [np.array([5])], "token_ids": [np.array([9, 8, 7])]})
    assert PromptTokens(trace)[0].tolist() == [9, 8, 7]


NON_FINITE_OR_HUGE = [
    ('{"timestamp": Infinity, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "'timestamp'.*finite"),
    ('{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "'timestamp'.*finite"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 100000000000000000000000000000, "hash_ids": [1, 2]}',
     "'output_length' must be an int in"),
    ('{"timestamp": 0, "input_length": 600, "output_length": NaN, "hash_ids": [1, 2]}', "'output_length'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 16777000, "hash_ids": [1, 2]}', "at most 16777216"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 10000000000000000000000]}',
     "hash_ids"),
    ('{"timestamp": 0, "input_length": ' + "9" * 5000 + "}", "not valid JSON"),
    ('{"timestamp": 0, "hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON"),
]


@pytest.mark.parametrize("bad, what", NON_FINITE_OR_HUGE,
                         ids=["inf-time", "nan-time", "huge-output", "nan-output", "too-many-tokens", "huge-hash-id",
                              "5000-digits", "deeply-nested"])
def test_non_finite_and_huge_numbers_in_a_jsonl_trace_name_their_line(tmp_path, bad, what):
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{GOOD_JSON}\n{bad}\n")
    with pytest.raises(TraceFormatError, match=rf"broken\.jsonl:2: .*{what}"):
        load_trace(path)


def test_huge_lengths_in_a_csv_trace_name_their_line(tmp_path):
    path = tmp_path / "broken.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{GOOD_CSV}\n"
                    "2023-11-16 18:17:04.0,12,100000000000000000000000000000\n")
    with pytest.raises(TraceFormatError, match=r"broken\.csv:3: GeneratedTokens must be an int in"):
        load_trace(path)


@pytest.mark.parametrize("suffix, good", [(".jsonl", GOOD_JSON), (".csv", GOOD_CSV)])
def test_invalid_utf8_names_its_line(tmp_path, suffix, good):
    path = tmp_path / f"broken{suffix}"
    header = b"TIMESTAMP,ContextTokens,GeneratedTokens\n" if suffix == ".csv" else b""
    path.write_bytes(header + f"{good}\n{good}\n".encode() + good.encode().replace(b"0", b"\xff", 1) + b"\n")
    with pytest.raises(TraceFormatError, match=rf"broken\{suffix}:{3 + bool(header)}: not valid UTF-8"):
        load_trace(path)


def test_a_row_the_csv_module_refuses_is_a_format_error(tmp_path):
    path = tmp_path / "broken.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{GOOD_CSV}\n{'9' * 200_000},1,1\n")
    with pytest.raises(TraceFormatError, match=r"broken\.csv:3: not a valid CSV row \(field larger"):
        load_trace(path)


@pytest.mark.parametrize("suffix, text", [
    (".csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n{GOOD_CSV}\n"), (".jsonl", f"{GOOD_JSON}\n")])
def test_a_byte_order_mark_is_accepted(tmp_path, suffix, text):
    path = tmp_path / f"excel{suffix}"
    path.write_text(text, encoding="utf-8-sig")  # what Excel and Notepad write
    trace = load_trace(path)
    assert len(trace) == 1 and trace["input_length"].iloc[0] in (4808, 600)


def test_a_missing_bundled_trace_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DATA", str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="bundled trace 'azure_code' is missing.*KVLAB_DATA"):
        load_trace("azure_code")


def frame(**columns) -> pd.DataFrame:
    base = {"timestamp": [0.0, 1.0], "input_length": [10, 20], "output_length": [1, 2]}
    return pd.DataFrame({**base, **columns})


@pytest.mark.parametrize("columns, what", [
    (dict(timestamp=[0.0, np.inf]), "timestamp must hold finite numbers"),
    (dict(timestamp=[np.nan, 1.0]), "timestamp must hold finite numbers"),
    (dict(input_length=[10.0, np.nan]), "input_length must hold ints"),
    (dict(input_length=pd.array([10, None], dtype="Int64")), "input_length must hold ints in"),
    (dict(output_length=[1, -1]), "output_length must hold ints in"),
    (dict(input_length=[10, 2**40]), "input_length must hold ints in"),
    (dict(input_length=[10, 2**24], output_length=[1, 1]), "input_length \\+ output_length"),
    (dict(token_ids=[np.arange(10), np.arange(19)]), "lengths of the token_ids column"),
])
def test_check_frame_names_the_column_and_row(columns, what):
    with pytest.raises(InvalidArgumentError, match=what):
        check_frame(frame(**columns))


# kv-cache-tester sessions (Claude Code traces): the bundled subset, and small hand-made sessions.

@pytest.fixture(scope="module")
def agentic():
    return load_trace("agentic_coding")


def test_the_bundled_agentic_subset_matches_its_provenance_note(agentic):
    """Counts and the checksum of the uncompressed sessions as data/README.md records them."""
    note = (data_dir() / "README.md").read_text()
    jsonl = lzma.decompress(trace_path("agentic_coding").read_bytes())
    recorded = re.search(r"([0-9a-f]{64})  kv_cache_tester_agentic\.sessions\.jsonl \(uncompressed\)", note)
    assert recorded and hashlib.sha256(jsonl).hexdigest() == recorded.group(1)
    assert agentic["session"].nunique() == len(jsonl.splitlines()) == 40
    subagents = agentic[agentic["agent"] != "main"]
    assert len(subagents) == 14 and subagents.groupby(["session", "agent"]).ngroups == 2
    assert "| `kv_cache_tester_agentic.sessions.jsonl.xz` | 1,969 |" in note
    # Ids are local to a session in the files; loaded, no id is shared by two sessions.
    ranges = agentic.groupby("session")["hash_ids"].agg(lambda ids: (min(map(min, ids)), max(map(max, ids))))
    bounds = np.array(sorted(ranges))
    assert (bounds[1:, 0] > bounds[:-1, 1]).all()


def session(name, requests, block_size=64):
    return {"id": name, "block_size": block_size, "requests": requests}


def request(t, n_in, ids, **extra):
    return {"t": t, "in": n_in, "out": 5, "hash_ids": ids, **extra}


def write_sessions(path, *sessions):
    path.write_text("".join(json.dumps(s) + "\n" for s in sessions))
    return path


def test_sessions_load_with_shifted_ids_fresh_tails_and_sub_agents(tmp_path):
    path = write_sessions(tmp_path / "mine.sessions.jsonl",
                          session("a", [request(0, 130, [0, 1], think_time=0, api_time=1.5),
                                        {"type": "subagent", "agent_id": "agent_001", "t": 2.0,
                                         "requests": [request(0.5, 64, [7])]},
                                        request(3, 200, [0, 1, 2], think_time=4)]),
                          session("b", [request(1, 70, [0])]))
    trace = load_trace(path)
    assert list(trace.columns) == SESSION_COLUMNS
    assert trace["timestamp"].tolist() == [0.0, 1000.0, 2500.0, 3000.0]   # sessions all start at 0; sorted
    assert trace["session"].tolist() == ["a", "b", "a", "a"]
    assert trace["agent"].tolist() == ["main", "main", "agent_001", "main"]
    assert trace["think_time_ms"].tolist()[::3] == [0.0, 4000.0] and trace["api_time_ms"].iloc[0] == 1500.0
    assert np.isnan(trace["api_time_ms"].iloc[3])
    # Session a's ids 0..7 stay; its partial tails get fresh ids past them (8, 9); session b starts at 10.
    assert [h.tolist() for h in trace["hash_ids"]] == [[0, 1, 8], [10, 11], [7], [0, 1, 2, 9]]
    prompts = PromptTokens(trace)
    first, last = prompts[0], prompts[3]
    assert len(first) == 130 and np.flatnonzero(first != last[:130])[0] == 128   # share exactly two blocks
    assert first[64 + 5] == 1 * 64 + 5


def test_a_request_without_hash_ids_shares_nothing(tmp_path):
    path = write_sessions(tmp_path / "x.sessions.jsonl",
                          session("a", [request(0, 128, [0, 1]), {"t": 1, "in": 128, "out": 1}]))
    trace = load_trace(path)
    assert [h.tolist() for h in trace["hash_ids"]] == [[0, 1], [2, 3]]


def test_a_single_json_session_and_an_xz_file_load_alike(tmp_path):
    one = session("a", [request(0, 130, [0, 1]), request(3, 200, [0, 1, 2])])
    (tmp_path / "trace_0001.json").write_text(json.dumps(one, indent=2))
    (tmp_path / "a.sessions.jsonl.xz").write_bytes(lzma.compress((json.dumps(one) + "\n").encode()))
    pd.testing.assert_frame_equal(load_trace(tmp_path / "trace_0001.json"),
                                  load_trace(tmp_path / "a.sessions.jsonl.xz"))
    assert len(load_trace(tmp_path / "a.sessions.jsonl.xz", limit=1)) == 1


def test_64_token_hash_ids_give_the_prefix_keys_the_tokens_give(agentic):
    trace = agentic.head(40)
    explicit = trace.assign(token_ids=[PromptTokens(trace)[i] for i in range(len(trace))])
    for block_size in (16, 64, 100):
        by_ids, by_tokens = block_keys(trace, block_size)[0], block_keys(explicit, block_size)[0]
        # the same partition of blocks into equal prefixes, whatever the numbering
        assert np.array_equal(np.unique(by_ids, return_inverse=True)[1], np.unique(by_tokens, return_inverse=True)[1])


def test_the_same_ids_of_another_size_are_other_blocks():
    """A Mooncake row (512-token ids) and a session row (64-token ids) with equal ids share no tokens, so no key."""
    trace = pd.DataFrame({"timestamp": [0.0, 1.0], "input_length": [128, 128], "output_length": [1, 1],
                          "hash_ids": [np.array([5]), np.array([5, 6])], "hash_id_tokens": [np.nan, 64]})
    prompts = PromptTokens(trace)
    assert not np.intersect1d(prompts[0], prompts[1]).size
    keys, request = block_keys(trace, 64)
    assert not np.intersect1d(keys[request == 0], keys[request == 1]).size


BAD_SESSIONS = [
    ([1, 2], "expected a JSON object"),
    ({"block_size": 64, "requests": []}, "string 'id'"),
    (session("s", [], block_size=1024), r"'block_size' must be an int in \[1, 512\]"),
    (session("s", {"t": 0}), "'requests' must be a list"),
    (session("s", [request(-1, 64, [0])]), r"requests\[0\]: 't' \(s\)"),
    (session("s", [request(0, 0, [])]), r"'in' must be an int"),
    (session("s", [request(0, 200, [0, 1])]), r"requests\[0\]: 2 hash_ids for 'in' 200; expected one per full"),
    (session("s", [request(0, 64, [-3])]), "'hash_ids' must be a list of ints"),
    (session("s", [request(0, 64, [0], think_time=float("inf"))]), "'think_time'"),
    (session("s", [{"type": "subagent", "t": 0, "requests": []}]), "string 'agent_id'"),
    (session("s", [{"type": "subagent", "agent_id": "x", "t": 0, "requests": [request(0, 64, "0")]}]),
     r"requests\[0\]\.requests\[0\]: 'hash_ids'"),
    (session("s", [request(0, 64, [2**31 - 1]), request(1, 130, [2**31 - 1, 5])]), "distinct hash ids"),
]


@pytest.mark.parametrize("bad, what", BAD_SESSIONS)
def test_a_malformed_session_names_the_line_session_and_request(tmp_path, bad, what):
    path = write_sessions(tmp_path / "broken.sessions.jsonl", session("ok", [request(0, 64, [0])]), bad)
    with pytest.raises(TraceFormatError, match=rf"broken\.sessions\.jsonl:2: .*{what}"):
        load_trace(path)


def test_a_corrupt_xz_file_is_a_format_error(tmp_path):
    path = tmp_path / "broken.sessions.jsonl.xz"
    path.write_bytes(b'{"id": "a"}\n')  # plain text under an .xz name
    with pytest.raises(TraceFormatError, match=r"broken\.sessions\.jsonl\.xz: not a valid xz file"):
        load_trace(path)


def test_hash_ids_of_more_than_512_tokens_are_refused():
    with pytest.raises(InvalidArgumentError, match="id_tokens"):
        mooncake_token_ids([1], 10, id_tokens=1024)


# Consecutive-request hit rates: each prompt against the previous one of its stream.

def test_each_request_hits_what_the_previous_request_of_its_stream_held(tmp_path):
    path = write_sessions(tmp_path / "c.sessions.jsonl",
                          session("a", [request(0, 256, [0, 1, 2, 3]),
                                        {"type": "subagent", "agent_id": "agent_001", "t": 1,
                                         "requests": [request(0, 128, [0, 1]), request(1, 192, [0, 1, 9])]},
                                        request(5, 320, [0, 1, 2, 7, 8]),    # 3 blocks of the previous prompt
                                        request(6, 320, [0, 1, 2, 7, 8])]),  # all 5, but the last is computed
                          session("b", [request(0, 128, [0, 1])]))           # ids of a, another session: a miss
    rates = consecutive_hit_rates(load_trace(path), 64)
    assert rates["hit_blocks"].to_dict() == {("a", "main"): 3 + 4, ("a", "agent_001"): 2, ("b", "main"): 0}
    assert rates.loc[("a", "main"), "full_blocks"] == 4 + 5 + 5
    assert rates.loc[("a", "main"), "hit_rate_tokens"] == pytest.approx(7 * 64 / (256 + 320 + 320))
    whole_session = consecutive_hit_rates(load_trace(path), 64, by="session")  # sub-agents interleaved
    assert whole_session.loc["a", "requests"] == 5


def test_consecutive_hit_rates_need_existing_stream_columns():
    with pytest.raises(InvalidArgumentError, match="streams are named by trace columns"):
        consecutive_hit_rates(load_trace("mooncake_synthetic", limit=5), 512, by="session")


def test_the_documented_agentic_hit_rates(agentic):
    """The figures docs/studies.md quotes for the bundled subset (the sessions' own streams, 64-token blocks)."""
    rates = consecutive_hit_rates(agentic, 64).xs("main", level="agent")["hit_rate_blocks"]
    assert len(rates) == 40
    assert (round(rates.median(), 4), round(rates.mean(), 4)) == (0.9419, 0.9238)
