"""Compile every kvlab Triton kernel for an NVIDIA GPU on a machine without one, as its launcher would.

CPU tests run the kernels in the Triton interpreter, which never lowers them, so GPU-only failures (a plain
Python constant inside a kernel instead of ``tl.constexpr``, a type or layout the NVIDIA backend rejects, a
tile that spills out of registers or needs more shared memory than the GPU has) would first show on a GPU.
Triton's wheel ships ptxas and cuobjdump, so this script compiles each launch variant (listed in
gpu_compile_variants.py) to a cubin for one target and reads the cubin's resource usage.

    python tests/kernels/gpu_compile_check.py --arch 90 [--json report.json] [--broken]

Exit status: 0 every variant compiled within bounds; 1 some did not (listed at the end); 77 no NVIDIA
toolchain (the caller skips). ``--broken`` compiles only deliberately broken kernels, to show that failures
are caught. The interpreter switch is read when each ``@triton.jit`` runs, so it is turned off here before
triton and kvlab are first imported: run this in its own process (test_gpu_compile.py does).
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SKIP_EXIT = 77
#: Spill budget per thread. Today's worst is 8 bytes (4 bytes spilled: fp32 head_dim 128 GQA-8 prefill on
#: sm_90); a tile that outgrows the register file spills kilobytes (fp32 prefill given the fp16 tiles: 1.6 KB
#: at 4 warps, 8 KB at head_dim 256), so this catches that with room for ptxas version noise.
MAX_STACK_BYTES = 64


@dataclass(frozen=True)
class Target:
    name: str
    capability: tuple
    num_sms: int           # the launcher sizes split-K for this many SMs (choose_num_partitions)
    max_shared_bytes: int  # per-block opt-in limit: Triton refuses to launch a kernel that asks for more
    bf16: bool             # native bf16 (sm_80+); elsewhere the launchers reject bf16 caches, so none is built


TARGETS = {
    90: Target("sm_90 (H100 SXM)", (9, 0), 132, 232448, bf16=True),
    80: Target("sm_80 (A100)", (8, 0), 108, 166912, bf16=True),
    75: Target("sm_75 (T4)", (7, 5), 40, 65536, bf16=False),  # Colab's free GPU
}


def toolchain_problem(arch):
    """Why this machine cannot compile for ``sm_<arch>``, or None."""
    import triton
    from triton.backends import backends

    if "nvidia" not in backends:
        return f"this Triton build has no NVIDIA backend (it has: {', '.join(sorted(backends)) or 'none'})"
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas  # Triton 3.9 uses ptxas-blackwell for sm_90+
    except ImportError as exc:
        return f"Triton {triton.__version__} lacks what this check (written for Triton 3.9) uses: {exc}"
    for tool, find in (("ptxas", lambda: get_ptxas(arch)), ("cuobjdump", lambda: knobs.nvidia.cuobjdump)):
        try:
            find()
        except RuntimeError as exc:
            return f"Triton's NVIDIA backend has no working {tool} for sm_{arch}: {exc}"
    return None


class CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: answers what the JIT asks before compiling (device, stream,
    target), so ``kernel.warmup`` builds a cubin for ``target``. It can never launch anything."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def prepare_process(arch):
    """Make this fresh process build Triton kernels for ``sm_<arch>`` as a GPU process would."""
    if any(name == "triton" or name.startswith("kvlab") for name in sys.modules):
        raise RuntimeError("prepare_process() must run before triton or kvlab is imported")
    # The interpreter switch is read when each @triton.jit runs: for triton.language's own helpers when
    # triton is imported, for kvlab's kernels when their modules are. kvlab.device turns it on again when
    # there is no CUDA, so it is turned off both before triton and after kvlab.device. (kvlab.device.ON_GPU
    # stays False: launch choices come from the config functions, given the target's capability.)
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import kvlab.device  # noqa: F401

    os.environ.pop("TRITON_INTERPRET", None)
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))


def resource_usage(compiled, cuobjdump):
    """{regs, stack, local, shared_static} of the cubin's one kernel, as cuobjdump reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"Function (\S+):\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", dump)
    if found is None or found.group(1) != compiled.name:
        raise RuntimeError(f"cuobjdump lists no resource usage for {compiled.name}:\n{dump}")
    regs, stack, shared, local = map(int, found.groups()[1:])
    return dict(regs=regs, stack=stack, local=local, shared_static=shared)


def check_variant(kernel, label, compile_variant, target, cuobjdump):
    """Compile one variant; returns its report row, with ``problems`` empty when it is fine."""
    row = dict(kernel=kernel, variant=label, target=target.name, problems=[])
    start = time.perf_counter()
    try:
        compiled = compile_variant()
    except Exception as exc:  # noqa: BLE001  (any compile error is this variant's result, not a crash)
        from triton.compiler.errors import CompilationError

        # A CompilationError in a jit helper is wrapped once per calling function; the innermost says what
        # went wrong in its last line (after "at line:col:" and the source), other errors in their first.
        chain = [exc]
        while (inner := chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)):
            chain.append(inner)
        lines = str(chain[-1]).strip().splitlines() or ["(no message)"]
        cause = lines[-1] if isinstance(chain[-1], CompilationError) else lines[0]
        row["problems"].append(f"does not compile: {type(chain[-1]).__name__}: {cause[:300]}")
        row["error"] = "\n".join(f"{type(e).__name__}: {str(e).strip()}" for e in chain)
        return row
    row.update(seconds=round(time.perf_counter() - start, 2), num_warps=compiled.metadata.num_warps,
               cubin_bytes=len(compiled.asm["cubin"]), shared_dynamic=compiled.metadata.shared)
    row.update(resource_usage(compiled, cuobjdump))
    if row["stack"] > MAX_STACK_BYTES:
        row["problems"].append(f"{row['stack']} bytes of stack per thread (spills; at most {MAX_STACK_BYTES})")
    if row["shared_dynamic"] > target.max_shared_bytes:
        row["problems"].append(f"asks for {row['shared_dynamic']} bytes of shared memory; "
                               f"{target.name} allows {target.max_shared_bytes}")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=sorted(TARGETS), required=True)
    parser.add_argument("--json", help="write every variant's report row here")
    parser.add_argument("--broken", action="store_true", help="compile only deliberately broken kernels")
    args = parser.parse_args(argv)

    if importlib.util.find_spec("triton") is None:
        print("cannot compile for NVIDIA GPUs on this machine: Triton is not installed")
        return SKIP_EXIT
    prepare_process(args.arch)
    problem = toolchain_problem(args.arch)
    if problem:
        print(f"cannot compile for NVIDIA GPUs on this machine: {problem}")
        return SKIP_EXIT
    import gpu_compile_variants  # only now: importing it builds the kernels
    from triton import knobs

    target = TARGETS[args.arch]
    variants = gpu_compile_variants.broken_variants if args.broken else gpu_compile_variants.kernel_variants
    rows = []
    for kernel, label, compile_variant in variants(target):
        row = check_variant(kernel, label, compile_variant, target, knobs.nvidia.cuobjdump.path)
        rows.append(row)
        usage = ("regs {regs:3} stack {stack:4} smem {shared_dynamic:6} warps {num_warps} {seconds:5.2f}s"
                 .format(**row) if "regs" in row else "-")
        print(f"{target.name} {kernel:30} {label:42} {usage}  {'FAILED' if row['problems'] else 'ok'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    failed = [row for row in rows if row["problems"]]
    for row in failed:
        print(f"FAILED {target.name} {row['kernel']} [{row['variant']}]: {'; '.join(row['problems'])}")
    errors = {}  # full compile error -> the variants failing with it
    for row in failed:
        if "error" in row:
            errors.setdefault(row["error"], []).append(f"{row['kernel']} [{row['variant']}]")
    for error, where in errors.items():
        print(f"\n{len(where)} variant(s) fail to compile with (first: {where[0]}):\n{error}\n")
    print(f"{len(rows) - len(failed)} of {len(rows)} variants compiled for {target.name} within bounds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
