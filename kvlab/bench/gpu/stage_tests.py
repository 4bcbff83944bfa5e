"""Stage tests: (1) the kernel and engine test suites with the interpreter off, (2) GPU-only sizes against the
torch twins and the race check (kernel_checks.py), (3) compute-sanitizer memcheck on one small launch of each
kernel (small_launches.py). In a dry run: one kernel test, one shrunk check per kernel in the interpreter, and
the small launches without the sanitizer."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import kvlab
from kvlab.bench.gpu.kernel_checks import GPU_CHECKS, accuracy, kernel_and_twin, same_bits
from kvlab.bench.gpu.small_launches import small_checks

ROOT = Path(kvlab.__file__).resolve().parents[1]
SUITES = ["tests/kernels", "tests/engine"]
#: The dry run's one test (under a second in the interpreter): it proves the pytest path, the checks below
#: cover every kernel.
DRY_RUN_TESTS = ["tests/kernels/test_copy_blocks.py::test_copy_blocks_on_allocated_caches"]
#: Shares of the stage's time for the suites and the checks; the sanitizer gets what is left.
SUITES_SHARE, CHECKS_SHARE = 0.55, 0.2


def run_bounded(command, seconds, env=None):
    """(return code or None when killed at ``seconds``, output). In its own session, so a kill takes its
    children (pytest workers) too."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=max(seconds, 1))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def pytest_command(dry_run):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    if dry_run:
        return command + DRY_RUN_TESTS
    if importlib.util.find_spec("xdist"):
        command += ["-n", "8"]  # compiling the kernel variants dominates: 8 processes share the 16 cores
    # not slow: test_gpu_compile's cross-compiles for sm_75/80/90 stand in for a GPU, which this stage has.
    return command + SUITES


def run_suites(stage):
    with stage.check("test suites" + (" (dry run: one kernel test)" if stage.dry_run else "")) as detail:
        if not (ROOT / "tests").is_dir():
            detail.update(status="skipped", text=f"no tests/ next to kvlab in {ROOT}")
            return
        seconds = SUITES_SHARE * stage.time_left()
        returncode, output = run_bounded(pytest_command(stage.dry_run), seconds)
        print(output, flush=True)  # the whole report goes to the log
        lines = output.strip().splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:8]
        last = lines[-1] if lines else "no output"
        if returncode is None:
            detail.update(status="timed out", text=f"killed after {seconds:.0f} s; last line: {last[:200]}")
        elif returncode != 0:
            raise AssertionError(f"{last}; " + "; ".join(failed))
        else:
            detail["text"] = last.strip("= ")


def run_kernel_checks(stage):
    """Each check against its twin, then again for the race check; stops early when its share is spent."""
    import torch

    from kvlab.device import DEVICE

    checks = small_checks() if stage.dry_run else GPU_CHECKS  # the dry run: one shrunk check per kernel
    stop = time.monotonic() + CHECKS_SHARE * stage.time_left() / (1 - SUITES_SHARE)
    for done, check in enumerate(checks):
        if time.monotonic() > stop:
            stage.record("gpu-only cases", "timed out", f"{len(checks) - done} of {len(checks)} not run: out of time")
            return
        torch.manual_seed(done)
        out = None
        with stage.check(check.name) as detail:
            kernel, twin = kernel_and_twin(check, DEVICE)
            out = kernel()
            detail["text"] = accuracy(check, out, twin())
        if out is not None:
            with stage.check(f"race: {check.name}") as detail:
                detail["text"] = same_bits(out, kernel())
        del out
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def run_sanitizer(stage):
    launches = [sys.executable, "-m", "kvlab.bench.gpu.small_launches"]
    sanitizer = shutil.which("compute-sanitizer")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    if stage.dry_run or sanitizer is None:
        why = "dry run" if stage.dry_run else "compute-sanitizer not found"
        stage.record("compute-sanitizer memcheck", "skipped", why)
        with stage.check("small launches, unsanitized") as detail:
            returncode, output = run_bounded(launches, stage.time_left(), env)
            print(output, flush=True)
            assert returncode == 0, f"exit status {returncode}: {output[-500:]}"
            detail["text"] = f"{output.count('launched ')} launches"
        return
    with stage.check("compute-sanitizer memcheck") as detail:
        command = [sanitizer, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "20", *launches]
        returncode, output = run_bounded(command, stage.time_left(), env)
        print(output, flush=True)
        summary = re.findall(r"ERROR SUMMARY: .*", output)
        said = f"{output.count('launched ')} launches; {summary[-1] if summary else 'no error summary'}"
        if returncode is None:
            detail.update(status="timed out", text=said)
        elif returncode != 0:
            raise AssertionError(f"exit status {returncode}: {said}")
        else:
            detail["text"] = said


def run(stage):
    run_suites(stage)
    run_kernel_checks(stage)
    run_sanitizer(stage)
