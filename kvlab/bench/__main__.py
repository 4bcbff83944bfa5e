"""``python -m kvlab.bench blocks|kernels|engine|gpu [options]`` (``--help`` after the name for its options)."""

import sys

from kvlab.cli.commands import dispatch

COMMANDS = {
    "blocks": ("block-manager speed on the Mooncake trace (optionally beside nano-vllm's)", "kvlab.bench.blocks:main"),
    "kernels": ("GPU kernel bandwidth beside torch SDPA (GPU only)", "kvlab.bench.kernels:main"),
    "engine": ("the engine beside Hugging Face generate: serving (CPU) or throughput (GPU)", "kvlab.bench.engine:main"),
    "gpu": ("the GPU run book: tests, kernels, engine and plots, time-boxed, into one folder (--dry-run on CPU)",
            "kvlab.bench.gpu.driver:main"),
}


def main(argv=None, prog: str = "python -m kvlab.bench") -> int:
    return dispatch(sys.argv[1:] if argv is None else list(argv), prog=prog, commands=COMMANDS,
                    description="kvlab's benchmarks: scripts that print numbers (no test times anything).")


if __name__ == "__main__":
    sys.exit(main())
