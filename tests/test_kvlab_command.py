import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kvlab
import kvlab.cli.commands
import kvlab.device
from kvlab.cli import main
from kvlab.bench.__main__ import main as bench_main


def test_info_reports_the_kernel_mode_and_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kvlab {kvlab.__version__}" in out and "torch" in out and "triton" in out
    assert ("mode: gpu" in out) or ("mode: interpreter" in out)
    assert f"engine attention backend: {kvlab.device.default_attention_backend()}" in out


def test_the_default_attention_backend_is_the_one_the_engine_resolves():
    import torch

    from kvlab.engine.settings import resolve_attention_backend

    for device in (torch.device("cpu"), torch.device("cuda")):
        assert resolve_attention_backend(None, device) == kvlab.device.default_attention_backend(device)
    assert kvlab.device.default_attention_backend(torch.device("cpu")) == "torch"
    assert kvlab.device.default_attention_backend(torch.device("cuda")) == "triton"
    summary = kvlab.device.summary()
    assert "\n" not in summary and f"attention backend: {kvlab.device.default_attention_backend()}" in summary
    assert ("compiled for" in summary) == (kvlab.device.mode() == "gpu")


def exit_status(command, argv) -> int:
    with pytest.raises(SystemExit) as exit_info:
        command(argv)
    return exit_info.value.code


@pytest.mark.parametrize("command, argv, choices", [
    (main, ["frobnicate"], ["study", "fleet", "validate", "size", "info", "bench"]),
    (bench_main, ["nothing"], ["blocks", "kernels", "engine"]),
    (main, ["bench", "nothing"], ["blocks", "kernels", "engine"]),
])
def test_an_unknown_command_is_named_with_the_choices(command, argv, choices, capsys):
    assert exit_status(command, argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert f"invalid choice: '{argv[-1]}'" in error and all(name in error for name in choices), error


@pytest.mark.parametrize("command, argv", [(main, []), (bench_main, []), (main, ["bench"])])
def test_a_missing_command_is_an_error(command, argv, capsys):
    assert exit_status(command, argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: the following arguments are required: COMMAND")


@pytest.mark.parametrize("command, argv, listed", [
    (main, ["--help"], ["study", "fleet", "validate", "size", "info", "bench", "engine", "kvlab COMMAND --help"]),
    (bench_main, ["-h"], ["blocks", "kernels", "engine", "python -m kvlab.bench COMMAND --help"]),
    (main, ["bench", "--help"], ["blocks", "kernels", "engine", "kvlab bench COMMAND --help"]),
    (main, ["info", "--help"], ["usage: kvlab info"]),
    (main, ["study", "--help"], ["usage: kvlab study"]),
    (main, ["fleet", "--help"], ["usage: kvlab fleet", "kv_cost"]),
    (main, ["validate", "--help"], ["usage: kvlab validate", "--full", "--csv", "--json", "tolerance"]),
    (main, ["size", "--help"], ["usage: kvlab size", "--kv-cache-dtype", "fp8_e5m2", "80GiB"]),
])
def test_help_lists_every_command_and_exits_0(command, argv, listed, capsys):
    assert exit_status(command, argv) == 0
    out = capsys.readouterr().out
    assert all(word in out for word in listed) and "``" not in out, out


def test_block_benchmark_runs_on_a_few_requests(capsys):
    assert bench_main(["blocks", "--limit", "5", "--pools", "2000"]) == 0
    header, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "us/block" in header and header.rstrip().endswith("hit rate")
    pool, blocks, us_per_block, hit_rate = last.split()
    assert pool == "2,000" and int(blocks.replace(",", "")) > 0
    assert float(us_per_block) > 0 and 0 <= float(hit_rate) <= 1


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """``kvlab size ... | head -1``: the pipe's reader leaves before the output is written; no traceback."""
    config = Path(__file__).parent / "sizing" / "configs" / "Qwen3-0.6B"
    child = subprocess.Popen([sys.executable, "-m", "kvlab", "size", "--model", str(config)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # long before the interpreter has started: every write meets a closed pipe
    _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGPIPE and err == b""


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(monkeypatch):
    """Only the reader of stdout leaving ends a command quietly; another broken pipe (a socket) is reported."""
    def breaks(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(kvlab.cli.commands.importlib, "import_module", lambda name: types.SimpleNamespace(main=breaks))
    with pytest.raises(BrokenPipeError):
        main(["size"])
