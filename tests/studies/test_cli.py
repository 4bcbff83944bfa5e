"""``kvlab study``: a small run writes the CSV with the required columns and the plot; bad options fail."""

import json
import math

import pandas as pd
import pytest

from kvlab.__main__ import main as kvlab_main
from kvlab.studies.cli import build_parser, main

REQUIRED = ["trace", "block_size", "capacity_blocks", "policy", "hit_rate_tokens", "hit_rate_blocks", "evictions",
            "prefill_tokens_saved", "peak_blocks_used"]


def test_a_small_study_writes_the_csv_and_the_plot(tmp_path, capsys):
    out = tmp_path / "res"
    code = main(["--trace", "mooncake_conversation", "--limit", "60", "--block-size", "512,64",
                 "--capacity", "50,inf", "--policy", "lru,fifo,lfu", "--out", str(out), "--quiet"])
    assert code == 0
    table = pd.read_csv(out / "study.csv")
    assert set(REQUIRED) <= set(table.columns) and len(table) == 1 * 2 * 2 * 3
    assert set(table["capacity_blocks"]) == {50, math.inf} and set(table["policy"]) == {"lru", "fifo", "lfu"}
    assert (out / "study.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "mooncake_conversation" in printed and "infinite cache would serve" in printed


def test_the_kvlab_command_dispatches_here_in_overlap_mode(tmp_path, capsys):
    trace = tmp_path / "mine.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 700, "output_length": 5,
                                         "hash_ids": [1, 2 + i % 2]}) + "\n" for i in range(6)))
    assert kvlab_main(["study", "--trace", str(trace), "--mode", "overlap", "--block-size", "16",
                       "--capacity", "inf", "--out", str(tmp_path), "--quiet"]) == 0
    table = pd.read_csv(tmp_path / "study.csv")
    assert table["trace"].unique().tolist() == ["mine"] and "mean_queue_s" in table.columns
    assert table["hit_rate_blocks"].iloc[0] > 0.5   # five of six requests reuse a 512-token block or more


def test_a_leading_study_word_is_accepted(tmp_path):
    assert main(["study", "--trace", "synthetic_parallel", "--limit", "8", "--capacity", "inf", "--policy", "lru",
                 "--out", str(tmp_path), "--quiet"]) == 0


@pytest.mark.parametrize("argv", [["--capacity", "0"], ["--capacity", "ten"], ["--policy", "lru,random"],
                                  ["--block-size", "-16"], ["--mode", "parallel"], ["--limit", "0"]])
def test_bad_options_exit_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "error" in capsys.readouterr().err


def test_an_unknown_trace_is_reported_without_a_traceback(tmp_path, capsys):
    assert main(["--trace", "no_such_trace", "--out", str(tmp_path), "--quiet"]) == 2
    assert "neither a bundled trace" in capsys.readouterr().err


def test_the_defaults_are_the_main_job():
    args = build_parser().parse_args([])
    assert args.trace == ["mooncake_conversation"] and args.block_size == [512] and args.mode == "sequential"
    assert args.capacity[-1] == math.inf and args.policy == ["lru", "fifo", "lfu"] and str(args.out) == "results"
