"""``python -m kvlab.bench blocks|kernels|engine [options]`` (``--help`` after the name for its options)."""

import sys

from kvlab.commands import dispatch

COMMANDS = {
    "blocks": ("block-manager speed on the Mooncake trace (optionally beside nano-vllm's)", "kvlab.bench.blocks:main"),
    "kernels": ("GPU kernel bandwidth beside torch SDPA (GPU only)", "kvlab.bench.kernels:main"),
    "engine": ("offline engine throughput beside Hugging Face generate", "kvlab.bench.engine:main"),
}


def main(argv=None, prog: str = "python -m kvlab.bench") -> int:
    return dispatch(sys.argv[1:] if argv is None else list(argv), prog=prog, commands=COMMANDS,
                    description="kvlab's benchmarks: scripts that print numbers (no test times anything).")


if __name__ == "__main__":
    sys.exit(main())
