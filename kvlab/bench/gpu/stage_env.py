"""Stage env: check what the other stages rely on before they run (the device machine's image is described,
not promised): versions, the GPU, the tools. A required package that is missing fails this stage, and the
log then says what to carry as a wheel."""

import importlib.metadata
import platform
import shutil
import subprocess

#: What the stages import. pytest-xdist (parallel tests) and flashinfer (a kernel peer) are used when present.
REQUIRED = ("torch", "triton", "transformers", "safetensors", "numpy", "pandas", "matplotlib", "xxhash", "tqdm",
            "pytest", "hypothesis")
OPTIONAL = ("pytest-xdist", "flashinfer-python")


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tool_output(command):
    """First lines of a tool's answer, or None when the tool is not on PATH."""
    if shutil.which(command[0]) is None:
        return None
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    return " | ".join((done.stdout or done.stderr).strip().splitlines()[:4])


def run(stage):
    import kvlab

    stage.record("python and kvlab", "ok", f"python {platform.python_version()}, kvlab {kvlab.__version__} "
                                           f"from {kvlab.__file__}")
    missing = [p for p in REQUIRED if version(p) is None]
    stage.record("required packages", "failed" if missing else "ok",
                 f"missing: {', '.join(missing)} (carry them as wheels)" if missing
                 else ", ".join(f"{p} {version(p)}" for p in REQUIRED))
    for package in OPTIONAL:
        found = version(package)
        stage.record(package, "ok" if found else "skipped", found or "not installed")
    with stage.check("gpu") as detail:
        from kvlab.device import ON_GPU, report

        if stage.dry_run:
            detail.update(status="skipped", text=f"dry run: {report().splitlines()[1]}")
        elif not ON_GPU:
            raise RuntimeError(f"no CUDA GPU visible to torch: {report()}")
        else:
            import torch

            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info()
            detail["text"] = (f"{' / '.join(report().splitlines()[1:])}; {props.multi_processor_count} SMs, "
                              f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    for check, command in (("nvidia-smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                                         "clocks.mem", "--format=csv,noheader"]),
                           ("compute-sanitizer", ["compute-sanitizer", "--version"])):
        with stage.check(check) as detail:
            answer = tool_output(command)
            detail.update(status="ok" if answer else "skipped", text=answer or "not found")
