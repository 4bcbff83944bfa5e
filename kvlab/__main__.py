"""The ``kvlab`` command (also ``python -m kvlab``).

    kvlab study [options]      cache-hit study on a trace (the main job; see ``kvlab study --help``)
    kvlab info                 which kernel mode is active (GPU or Triton interpreter), with versions
    kvlab bench blocks|kernels block-manager or GPU-kernel benchmark
"""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "study":
        from kvlab.studies.cli import main as study
        return study(rest)
    if command == "info":
        import kvlab
        print(kvlab.report())
        return 0
    if command == "bench":
        from kvlab.bench.__main__ import main as bench
        return bench(rest)
    print(__doc__.strip(), file=sys.stderr)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
