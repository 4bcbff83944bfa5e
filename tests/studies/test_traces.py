"""Trace loaders: bundled traces, user files in the same shapes, malformed input, token-id expansion."""

import json

import numpy as np
import pandas as pd
import pytest

from kvlab.errors import InvalidArgumentError, TraceFormatError
from kvlab.traces import (BUNDLED, COLUMNS, MOONCAKE_BLOCK_TOKENS, PromptTokens, load_trace, mooncake_token_ids,
                          private_token_ids)

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
    ("2023-11-16 18:17:04.0,0,5", "ContextTokens >= 1"),
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
