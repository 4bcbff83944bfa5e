"""The GPU run book, rehearsed on CPU: ``python -m kvlab.bench gpu --dry-run`` goes through every stage in the
Triton interpreter and leaves at most 8 flat files (what the device machine hands back); a stage that fails
or outruns its box is recorded and the next one still runs."""

import csv

import pandas as pd
import pytest

from kvlab.bench.__main__ import main as bench_main
from kvlab.bench.gpu import driver
from kvlab.bench.gpu.report import LOG, PLOTS, SUMMARY, SUMMARY_COLUMNS
from kvlab.bench.kernels import CSV_COLUMNS, DRY_RUN_LABEL, gpu_slug

SLUG = gpu_slug(DRY_RUN_LABEL)


def summary(out):
    with (out / SUMMARY).open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_dry_run_writes_every_file_flat(tmp_path, capsys):
    assert bench_main(["gpu", "--out", str(tmp_path), "--dry-run"]) == 0, (tmp_path / LOG).read_text()[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all((tmp_path / name).is_file() for name in files) and len(files) <= 8
    assert set(files) == {LOG, SUMMARY, f"{SLUG}.csv", f"engine-{SLUG}.csv", *PLOTS}
    rows = summary(tmp_path)
    assert tuple(rows[0]) == SUMMARY_COLUMNS
    stages = {r["stage"]: r["status"] for r in rows if r["check"] == "(stage)"}
    assert stages == dict.fromkeys(("env", "tests", "kernels", "engine", "plots"), "ok")

    kernels = pd.read_csv(tmp_path / f"{SLUG}.csv")
    assert tuple(kernels.columns) == CSV_COLUMNS and (kernels["gpu"] == DRY_RUN_LABEL).all()
    assert set(kernels["kernel"]) == {"decode", "prefill", "reshape_and_cache", "copy_blocks", "swap_out", "swap_in"}
    assert {"kvlab", "kvlab_split_k", "torch_sdpa_contiguous", "flex_attention_paged"} <= set(kernels["impl"])
    fp8 = kernels[kernels["dtype"] == "fp8_e4m3"]  # the fp8 cache's reads (the interpreter reads fp8 exactly)
    assert set(fp8["kernel"]) == {"decode", "prefill"} and {"kvlab", "kvlab_split_k"} <= set(fp8["impl"])
    engine = pd.read_csv(tmp_path / f"engine-{SLUG}.csv")
    assert set(engine["system"]) == {"kvlab.engine (v1)", "kvlab.engine (v0)", "hf-continuous-batching", "hf-generate"}
    assert {"generated_tok_s", "ttft_ms_median", "itl_ms_median", "vs_hf"} <= set(engine.columns)
    checks = {r["check"]: r["status"] for r in rows}
    kivi = {name.split()[0] for name, status in checks.items() if name.startswith("kivi_") and status == "ok"}
    assert kivi == {"kivi_seal", "kivi_decode", "kivi_prefill"}, checks
    assert checks["CUDA-graph decode"] == "skipped" and checks["compute-sanitizer memcheck"] == "skipped"
    assert checks["kvlab.engine (v1)"] == checks["kvlab.engine (v0)"] == "ok"


def test_the_run_book_checks_the_kivi_kernels_against_their_twins():
    """The GPU checks name KIVI's write (``kivi_seal``) and reads (``kivi_paged_attention``, decode and prefill);
    the dry run's shrunk ones pass in the interpreter: the seal bit for bit, the reads within tolerance of
    ``kivi_read_torch`` with no NaN from the poisoned pages, and a second run gives the same bits."""
    from kvlab.bench.gpu.kernel_checks import GPU_CHECKS, accuracy, kernel_and_twin, same_bits
    from kvlab.bench.gpu.small_launches import small_checks
    from kvlab.device import DEVICE

    assert {c.kernel for c in GPU_CHECKS if c.kv_format} == {"kivi_seal", "kivi_decode", "kivi_prefill"}
    small = [c for c in small_checks() if c.kv_format]
    assert [c.kernel for c in small] == ["kivi_seal", "kivi_decode", "kivi_prefill"]
    for check in small:
        kernel, twin = kernel_and_twin(check, DEVICE)
        out = kernel()
        assert accuracy(check, out, twin()) and same_bits(out, kernel())


def test_a_failing_stage_is_logged_and_the_next_still_runs(tmp_path):
    # plots first, into an empty folder: its CSVs are missing, so it fails; env runs after it all the same.
    assert driver.main(["--out", str(tmp_path), "--dry-run", "--stages", "plots,env"]) == 1
    rows = summary(tmp_path)
    stages = {r["stage"]: r for r in rows if r["check"] == "(stage)"}
    assert stages["plots"]["status"] == "failed" and stages["env"]["status"] == "ok"
    assert any(r["stage"] == "plots" and "missing" in r["detail"] for r in rows)
    log = (tmp_path / LOG).read_text()
    assert "==== stage plots: failed" in log and "FileNotFoundError" in log and "==== stage env: ok" in log


def test_a_stage_past_its_box_is_killed_and_recorded(tmp_path):
    assert driver.main(["--out", str(tmp_path), "--dry-run", "--stages", "env", "--time-box", "env=0.2"]) == 1
    (row,) = [r for r in summary(tmp_path) if r["check"] == "(stage)"]
    assert row["status"] == "timed out" and "0.2 s box" in row["detail"]


@pytest.mark.parametrize("argv", [["--stages", "env,nope"], ["--time-box", "env=soon"], ["--time-box", "nope=3"]])
def test_bad_arguments_are_refused(tmp_path, argv):
    with pytest.raises(SystemExit):
        driver.main(["--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


def test_help_names_the_run_book(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    assert "gpu" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["gpu", "--help"])
    assert exit_info.value.code == 0 and "--dry-run" in capsys.readouterr().out
