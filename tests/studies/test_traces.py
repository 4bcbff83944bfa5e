"""Trace loaders: bundled traces, user files in the same shapes, malformed input, token-id expansion."""

import json

import numpy as np
import pandas as pd
import pytest

from kvlab.errors import InvalidArgumentError, TraceFormatError
from kvlab.studies.traces import (BUNDLED, COLUMNS, MOONCAKE_BLOCK_TOKENS, PromptTokens, check_frame, load_trace,
                                  mooncake_token_ids, private_token_ids)

RECORDS = {"mooncake_conversation": 12_031, "mooncake_synthetic": 3_993, "azure_code": 8_819, "azure_conv": 19_366}


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_traces_load_with_the_normalised_columns(name):
    trace = load_trace(name)
    assert list(trace.columns) == COLUMNS and len(trace) == RECORDS[name]
    assert (trace["input_length"] >= 1).all() and (trace["output_length"] >= 0).all()
    assert trace["timestamp"].iloc[0] == 0 and trace["timestamp"].is_monotonic_increasing
    if name.startswith("mooncake"):
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
