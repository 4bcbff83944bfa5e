"""``python -m kvlab.bench blocks [options]`` or ``python -m kvlab.bench kernels [options]``."""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("blocks", "kernels"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "blocks":
        from kvlab.bench.blocks import main as run
    else:
        from kvlab.bench.kernels import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
