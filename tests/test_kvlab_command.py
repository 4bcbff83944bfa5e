import kvlab
from kvlab.__main__ import main
from kvlab.bench.__main__ import main as bench_main


def test_info_reports_the_kernel_mode_and_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kvlab {kvlab.__version__}" in out and "torch" in out and "triton" in out
    assert ("mode: gpu" in out) or ("mode: interpreter" in out)


def test_unknown_commands_print_usage_and_fail(capsys):
    assert main(["frobnicate"]) == 2 and "kvlab study" in capsys.readouterr().err
    assert bench_main(["nothing"]) == 2 and "blocks" in capsys.readouterr().err


def test_block_benchmark_runs_on_a_few_requests(capsys):
    assert bench_main(["blocks", "--limit", "5", "--pools", "2000"]) == 0
    header, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "us/block" in header and header.rstrip().endswith("hit rate")
    pool, blocks, us_per_block, hit_rate = last.split()
    assert pool == "2,000" and int(blocks.replace(",", "")) > 0
    assert float(us_per_block) > 0 and 0 <= float(hit_rate) <= 1
