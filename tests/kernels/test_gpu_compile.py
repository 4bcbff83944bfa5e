"""Every kvlab Triton kernel compiles for Hopper (sm_90), Ampere (sm_80) and Turing (sm_75: Colab's free T4)
GPUs in the variants its launcher produces (dtypes, head dims, block sizes, GQA, split-K, window / soft-cap),
without spilling registers or asking for more shared memory than the GPU has. Checked on CPU, where the
other kernel tests only run the Triton interpreter, which misses GPU-only compile errors;
gpu_compile_check.py explains how."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab

CHECK = Path(__file__).with_name("gpu_compile_check.py")
SKIP_EXIT = 77  # gpu_compile_check.py: no NVIDIA toolchain here
ARCHS = (90, 80, 75)
KERNELS = {"reshape_and_cache_kernel", "copy_blocks_kernel", "paged_attention_decode_kernel",
           "split_k_reduce_kernel", "paged_prefill_kernel", "mla_decode_kernel", "kivi_seal_kernel",
           "kivi_paged_attention_kernel"}


class Check:
    """gpu_compile_check.py running in a fresh process without the interpreter switch (this process built
    triton's and kvlab's kernels for the interpreter when it imported them); output goes to files in
    ``workdir``, so a long report can never fill a pipe and stall it."""

    def __init__(self, workdir, *args):
        workdir.mkdir(parents=True, exist_ok=True)
        env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
        # The kvlab this session imported, even where another checkout is the one installed in the venv.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(kvlab.__file__).parents[1]),
                                                          env.get("PYTHONPATH")]))
        env["TRITON_CACHE_DIR"] = str(workdir / "triton_cache")  # really compile, and leave ~/.triton alone
        self.report, self.stdout, self.stderr = (workdir / name for name in ("report.json", "stdout", "stderr"))
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            # Niced: started early (conftest.py), it compiles on the core the tests leave idle, never on theirs.
            self.process = subprocess.Popen([sys.executable, str(CHECK), *args, "--json", str(self.report)],
                                            env=env, stdout=out, stderr=err, text=True,
                                            preexec_fn=lambda: os.nice(10))

    def result(self):
        """(exit status, stdout, report rows) once it has finished; skips the test without a toolchain."""
        returncode = self.process.wait(timeout=600)
        stdout = self.stdout.read_text()
        if returncode == SKIP_EXIT:
            pytest.skip(stdout.strip())
        if returncode not in (0, 1):  # crashed rather than reporting
            stdout += self.stderr.read_text()[-3000:]
        rows = json.loads(self.report.read_text()) if self.report.exists() else []
        return returncode, stdout, rows

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


#: The checks conftest.py started as soon as the session's tests were chosen (arch -> Check), so that they compile
#: on the core the single-threaded tests before this one leave idle; empty where this file was run on its own.
STARTED: dict = {}


def start_checks(workdir: Path) -> dict:
    """Every target's check, started together: they share the machine's cores rather than wait in turn."""
    return {arch: Check(workdir / f"sm_{arch}", "--arch", str(arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def target_checks(tmp_path_factory):
    checks = STARTED or start_checks(tmp_path_factory.mktemp("gpu_compile"))
    yield checks
    for check in checks.values():
        check.stop()


def failure_summary(stdout):
    """What the check printed after its per-variant table (FAILED lines, compile errors, verdict), or how it
    crashed."""
    start = stdout.find("\nFAILED ")
    return stdout[start + 1:][:8000] if start >= 0 else stdout[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{arch}" for arch in ARCHS])
def test_every_kernel_variant_compiles_within_bounds(arch, target_checks):
    returncode, stdout, rows = target_checks[arch].result()
    if returncode != 0:
        pytest.fail(f"kernel variants fail on sm_{arch}:\n{failure_summary(stdout)}", pytrace=False)
    assert {row["kernel"] for row in rows} == KERNELS
    for row in rows:
        assert row["cubin_bytes"] > 0 and not row["problems"], row


def test_check_reports_gpu_only_bugs(tmp_path):
    """The check can fail: a plain Python constant inside a kernel (fine in the interpreter), a tile that
    spills out of registers and a launch asking for more shared memory than the GPU has (decode's old fp32
    head_dim 256 tile on a T4) are all reported, each naming its kernel."""
    returncode, stdout, rows = Check(tmp_path, "--arch", "75", "--broken").result()
    assert returncode == 1, failure_summary(stdout)
    problems = {row["kernel"]: " ".join(row["problems"]) for row in rows}
    assert "Cannot access global variable UNSCALED" in problems["global_constant_kernel"]
    assert "bytes of stack per thread" in problems["spilling_kernel"]
    assert "asks for 81920 bytes of shared memory; sm_75 (T4) allows 65536" \
        in problems["paged_attention_decode_kernel"]
    for kernel in problems:
        assert f"FAILED sm_75 (T4) {kernel}" in stdout
