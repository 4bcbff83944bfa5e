"""The engine benchmark's workloads and command line (the benchmark itself is a script, never timed here)."""

import pytest

from kvlab.bench.__main__ import main as bench_main
from kvlab.bench.engine import CPU_WORKLOAD, make_workloads


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
