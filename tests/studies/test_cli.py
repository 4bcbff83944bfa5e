"""``kvlab study``: a small run writes the CSV with the required columns and the plot; bad options fail."""

import json
import math
import os
import re
import tempfile

import pandas as pd
import pytest

from kvlab.cli import main as kvlab_main
from kvlab.studies.cli import build_parser, main
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.traces import BUNDLED

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


def test_a_study_with_a_tier_writes_per_tier_columns_ttft_and_residency(tmp_path, capsys):
    code = main(["--limit", "300", "--capacity", "200,inf", "--policy", "lru", "--offload-capacity", "0,2000",
                 "--offload-policy", "lru,arc", "--offload-admission", "always,reused", "--kv-cache-metrics-sample",
                 "0.5", "--h2d-gb-per-s", "5", "--out", str(tmp_path), "--quiet", "--jobs", "1"])
    assert code == 0
    table = pd.read_csv(tmp_path / "study.csv")
    assert len(table) == 2 * (1 + 2 * 2)
    assert table["offload_capacity_blocks"].tolist()[:5] == [0, 2000, 2000, 2000, 2000]
    assert table["offload_policy"].tolist()[:5] == ["none", "lru", "lru", "arc", "arc"]
    assert table["offload_admission"].tolist()[:5] == ["none", "always", "reused", "always", "reused"]
    total = table["gpu_hit_blocks"] + table["tier_hit_blocks"]
    assert (total + table["miss_blocks"]).nunique() == 1 and table.loc[1, "tier_hit_blocks"] > 0
    assert table["hit_rate_blocks"].tolist() == pytest.approx((total / (total + table["miss_blocks"])).tolist())
    assert (table["gpu_hit_tokens"] + table["tier_hit_tokens"] + table["miss_tokens"] == table["prompt_tokens"]).all()
    # At 5 GB/s a 64 MiB block loads in 13.4 ms, slower than recomputing it (10.24 ms): the tier gains nothing.
    assert (table["ttft_tier_gain_ms"] == 0).all()
    assert table.loc[0, "gpu_lifetime_s_count"] > 0 and "cpu_idle_s_p90" in table
    assumptions = (tmp_path / "ttft_model.txt").read_text()
    assert "host to device 5 GB/s" in assumptions and "a tier hit saves nothing" in assumptions
    printed = capsys.readouterr().out
    assert assumptions.strip() in printed and "+ 2,000-block tier (arc, reused)" in printed
    assert "residency (seconds on the trace's clock" in printed


def test_a_tier_in_overlap_mode_is_one_error_line(tmp_path, capsys):
    assert main(["--mode", "overlap", "--offload-capacity", "100", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab study: error: an offload tier and residency metrics are replayed in sequential "
                          "mode only") and "Traceback" not in err


def test_a_leading_study_word_is_accepted(tmp_path):
    assert main(["study", "--trace", "synthetic_parallel", "--limit", "8", "--capacity", "inf", "--policy", "lru",
                 "--out", str(tmp_path), "--quiet"]) == 0


HUGE = "1" + "0" * 30


@pytest.mark.parametrize("argv, message", [
    (["--capacity", "0"], "--capacity: expected a number of blocks in"),
    (["--capacity", "ten"], "--capacity: expected a number of blocks in"),
    (["--capacity", "1e30"], "--capacity: expected a number of blocks in"),
    (["--capacity", HUGE], "--capacity: expected a number of blocks in \\[1, 16,777,216\\]"),
    (["--capacity", "16777217"], "--capacity: expected a number of blocks in \\[1, 16,777,216\\]"),
    (["--policy", "lru,random"], "--policy: unknown eviction policy 'random'"),
    (["--block-size", "-16"], "--block-size: block_size must be an int in"),
    (["--block-size", "1e30"], "--block-size: expected a whole number, got '1e30'"),
    (["--block-size", HUGE], "--block-size: block_size must be an int in"),
    (["--mode", "parallel"], "--mode: invalid choice"),
    (["--block-size", "16,16"], "--block-size: '16' is given more than once in '16,16'"),
    (["--capacity", "1000,inf,1000"], "--capacity: '1000' is given more than once"),
    (["--capacity", "10,,20"], "--capacity: expected a comma-separated list without empty items, got '10,,20'"),
    (["--policy", "lru,"], "--policy: expected a comma-separated list without empty items"),
    (["--trace", ""], "--trace: expected a comma-separated list without empty items"),
    (["--limit", "0"], "--limit: limit must be an int >= 1, got 0"),
    (["--time-scale", "inf"], "--time-scale: time scale must be a finite number > 0, got inf"),
    (["--time-scale", "nan"], "--time-scale: time scale must be a finite number > 0, got nan"),
    (["--time-scale", "-1"], "--time-scale: time scale must be a finite number > 0"),
    (["--jobs", "0"], "--jobs: jobs must be an int >= 1, got 0"),
    (["--dask-timeout", "0"], "--dask-timeout: dask timeout must be a finite number > 0, got 0.0"),
    (["--dask-timeout", "inf"], "--dask-timeout: dask timeout must be a finite number > 0, got inf"),
    (["--offload-capacity", "-1"], "--offload-capacity: expected a number of CPU blocks in \\[0, 16,777,216\\]"),
    (["--offload-capacity", "lots"], "--offload-capacity: expected a number of CPU blocks in"),
    (["--offload-capacity", "0,8000,0"], "--offload-capacity: '0' is given more than once"),
    (["--offload-policy", "lru,mru"], "--offload-policy: unknown offload policy 'mru'; known: lru, arc"),
    (["--offload-admission", "never"], "--offload-admission: unknown offload admission 'never'; known: always, reused"),
    (["--kv-cache-metrics-sample", "0"], "--kv-cache-metrics-sample: kv cache metrics sample must be a finite number"),
    (["--kv-cache-metrics-sample", "1.5"], "--kv-cache-metrics-sample: kv cache metrics sample must be"),
    (["--ttft-model", "gpt-5"], "--ttft-model: invalid choice: 'gpt-5'"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype: invalid choice: 'fp4'"),
    (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s: prefill tokens per s must be a finite number > 0"),
    (["--h2d-gb-per-s", "-5"], "--h2d-gb-per-s: h2d GB per s must be a finite number > 0"),
])
def test_bad_options_exit_with_status_2_and_one_argparse_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert re.search(rf"^kvlab study: error: argument {message}", err, re.MULTILINE), err


def refuse_to_run(*args, **kwargs):
    raise AssertionError("the study ran before --out was checked")


@pytest.mark.parametrize("out, message", [("a_file", "exists and is not a directory"),
                                          ("a_file/below", "cannot write in .*Not a directory")])
def test_an_unusable_out_fails_before_the_study_runs(out, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setattr("kvlab.studies.cli.cache_hit_study", refuse_to_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / out)])
    assert exit_info.value.code == 2 and re.search(f"error: argument --out: .*{message}", capsys.readouterr().err)


def test_a_refused_study_leaves_no_out_directory_behind(tmp_path, capsys):
    out = tmp_path / "new" / "results"
    assert main(["--trace", str(tmp_path / "missing.jsonl"), "--out", str(out), "--quiet"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err and not (tmp_path / "new").exists()


def can_write_in(path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/sys") or can_write_in("/sys"), reason="needs a directory we cannot write in")
def test_an_out_directory_without_write_permission_fails_before_the_study_runs(monkeypatch, capsys):
    monkeypatch.setattr("kvlab.studies.cli.cache_hit_study", refuse_to_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "/sys"])
    assert (exit_info.value.code == 2
            and "error: argument --out: cannot create files in /sys (" in capsys.readouterr().err)


def can_make_a_directory_in(path) -> bool:
    try:
        with tempfile.TemporaryDirectory(dir=path):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc") or can_make_a_directory_in("/proc"),
                    reason="needs /proc, which refuses new directories")
def test_an_out_that_cannot_be_created_says_so_not_that_its_parent_is_missing(monkeypatch, capsys):
    monkeypatch.setattr("kvlab.studies.cli.cache_hit_study", refuse_to_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "/proc/kvlab_results"])
    # /proc answers "No such file or directory": the message must not read as if /proc were missing.
    assert exit_info.value.code == 2 and ("error: argument --out: cannot create the directory /proc/kvlab_results: "
                                          "/proc does not take new directories (") in capsys.readouterr().err


def test_an_empty_out_is_refused_not_taken_as_the_current_directory(monkeypatch, capsys):
    monkeypatch.setattr("kvlab.studies.cli.cache_hit_study", refuse_to_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", ""])
    assert exit_info.value.code == 2
    assert "argument --out: out must be a directory, got an empty string" in capsys.readouterr().err


def test_an_infinite_timestamp_in_a_trace_is_reported_not_replayed_forever(tmp_path, capsys):
    trace = tmp_path / "forever.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                     '{"timestamp": Infinity, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    assert main(["--trace", str(trace), "--mode", "overlap", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"kvlab study: error: .*forever\.jsonl:2: 'timestamp' \(ms\) must be a finite number >= 0, "
                        r"got inf\n", err), err


def test_an_unreachable_dask_scheduler_is_one_line(tmp_path, capsys):
    assert main(["--trace", "synthetic_parallel", "--limit", "4", "--dask-scheduler", "localhost",
                 "--out", str(tmp_path), "--quiet"]) == 2
    assert re.fullmatch(r"kvlab study: error: cannot use the Dask scheduler at 'localhost': .*\n",
                        capsys.readouterr().err)


def test_an_unknown_trace_is_reported_with_every_trace_name(tmp_path, capsys):
    assert main(["--trace", "no_such_trace", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("kvlab study: error: trace 'no_such_trace' is neither a trace name (")
            and "Traceback" not in err)
    assert all(name in err for name in [*BUNDLED, *WORKLOADS]), err


def test_the_defaults_are_the_main_job():
    args = build_parser().parse_args([])
    assert args.trace == ["mooncake_conversation"] and args.block_size == [512] and args.mode == "sequential"
    assert args.capacity[-1] == math.inf and args.policy == ["lru", "fifo", "lfu"] and str(args.out) == "results"
    assert args.offload_capacity == [0] and args.kv_cache_metrics_sample is None
