"""The engine benchmark's workloads and command line (the benchmark itself is a script, never timed here)."""

import pandas as pd
import pytest

from kvlab.bench.__main__ import main as bench_main
from kvlab.bench.engine import CPU_WORKLOAD, make_workloads
from kvlab.bench.scheduling import latency_row


def test_workloads_are_reproducible_and_share_the_system_prompt():
    workloads = make_workloads(vocab=100, seed=0, spec=CPU_WORKLOAD)
    assert workloads == make_workloads(vocab=100, seed=0, spec=CPU_WORKLOAD)
    prompts, outputs = workloads["random"]
    assert len(prompts) == len(outputs) == CPU_WORKLOAD["requests"]
    assert all(CPU_WORKLOAD["input_len"][0] <= len(p) <= CPU_WORKLOAD["input_len"][1] for p in prompts)
    shared, _ = workloads["shared-prefix"]
    prefix = shared[0][:CPU_WORKLOAD["prefix_len"]]
    assert all(p[:len(prefix)] == prefix and len(p) > len(prefix) for p in shared)


def test_help_describes_the_gpu_and_cpu_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["engine", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--model" in text and "Qwen3-0.6B" in text and "Triton interpreter" in text


def test_latency_row_counts_every_gap_so_a_stall_shows_in_the_tail():
    # two requests: the second gets its first token at 3.0 s, the first stalls 1.0 -> 3.0 between tokens
    row = latency_row([[1.0, 1.1, 3.0, 3.1], [3.0, 3.2]], wall=3.2)
    assert row["ttft_ms_p50"] == pytest.approx(2000) and row["itl_ms_max"] == pytest.approx(1900)
    assert row["itl_ms_p50"] == pytest.approx(150) and row["itl_ms_p99"] > 1800  # gaps 100, 1900, 100, 200


def test_scheduling_suite_writes_v0_v1_and_hf_rows(tmp_path, capsys):
    assert bench_main(["engine", "--suite", "scheduling", "--requests", "4", "--scale", "0.01", "--max-num-seqs",
                       "2", "--out-dir", str(tmp_path)]) == 0
    frame = pd.read_csv(next(tmp_path.glob("*.csv")))
    assert list(frame["system"]) == ["kvlab v0", "kvlab v1", "hf-generate"]
    assert (frame["scale"] == 0.01).all() and "scaled by 0.01" in capsys.readouterr().out
    engine = frame.iloc[:2]
    assert engine[[f"{m}_ms_p{p}" for m in ("ttft", "itl") for p in (50, 90, 99)]].notna().all().all()
    # V0 never mixes; V1 prefills the queued requests inside decode steps
    assert list(engine["mixed_steps"]) == [0, engine["mixed_steps"].iloc[1]] and engine["mixed_steps"].iloc[1] > 0
    assert (frame["generated_tok_s"] > 0).all()


def test_chat_suite_writes_its_numbers_with_the_machine_date_command_and_load(tmp_path, monkeypatch, capsys):
    import json

    import kvlab.bench.chat as chat

    measured = pd.DataFrame([dict(device="here", model="m", dtype="float32", attention_backend="torch", system=s,
                                  repeats=1, wall_s=w, min_s=w, max_s=w, generated_tok_s=256 / w, x_kvlab_time=w / 4,
                                  peak_kv_mib=1.0, cached_prompt_tokens=0)
                             for s, w in ((chat.KVLAB, 4.0), (chat.HF_PADDED, 5.0), (chat.HF_SEQUENTIAL, 17.0))])
    monkeypatch.setattr(chat, "run_chat", lambda model_dir, base, repeats: measured)  # SmolLM2 takes minutes
    argv = ["--suite", "chat", "--model", str(tmp_path), "--repeats", "1", "--out-dir", str(tmp_path / "out")]
    assert bench_main(["engine", *argv]) == 0
    csv, = (tmp_path / "out").glob("*.csv")
    assert list(pd.read_csv(csv)["system"]) == [chat.KVLAB, chat.HF_PADDED, chat.HF_SEQUENTIAL]
    record = json.loads(csv.with_suffix(".json").read_text())
    assert record["command"] == "python -m kvlab.bench engine " + " ".join(argv)
    assert record["date"].startswith("20") and record["machine"]["cpu_cores"] >= 1
    assert set(record) >= {"load_average_before", "load_average_after"}
    assert "load average" in capsys.readouterr().out
