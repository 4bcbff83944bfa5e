"""``python -m kvlab.bench blocks|kernels|engine [options]`` (``--help`` after the name for its options)."""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("blocks", "kernels", "engine"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "blocks":
        from kvlab.bench.blocks import main as run
    elif argv[0] == "engine":
        from kvlab.bench.engine import main as run
    else:
        from kvlab.bench.kernels import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
