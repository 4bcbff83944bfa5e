"""``python -m kvlab.bench blocks|kernels|engine|gpu [options]`` (``--help`` after the name for its options).

  blocks   block-manager throughput on the Mooncake conversation trace
  kernels  the Triton kernels beside their peers, GB/s (needs a GPU)
  engine   kvlab.engine against Hugging Face generate
  gpu      the GPU run book: tests, kernels, engine and plots in one time-boxed run (--dry-run on CPU)"""

import sys

COMMANDS = ("blocks", "kernels", "engine", "gpu")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "blocks":
        from kvlab.bench.blocks import main as run
    elif argv[0] == "engine":
        from kvlab.bench.engine import main as run
    elif argv[0] == "gpu":
        from kvlab.bench.gpu.driver import main as run
    else:
        from kvlab.bench.kernels import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
