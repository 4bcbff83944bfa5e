"""One stage of the run book, in its own process: ``python -m kvlab.bench.gpu.stage NAME --out DIR --report FILE
--seconds S [--dry-run] [--model DIR]``. Started by driver.py, which kills it at S seconds; the stage itself
aims to finish a margin earlier, so that it can say what it left out. Exit status 1 when a check failed."""

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from kvlab.bench.gpu.report import Stage

STAGES = ("env", "tests", "kernels", "engine", "plots")


def margin(seconds: float) -> float:
    """Time kept back from a stage's box to wrap up: a fifth, at most 30 s."""
    return min(30.0, seconds / 5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench.gpu.stage")
    parser.add_argument("name", choices=STAGES)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--model")
    args = parser.parse_args(argv)
    stage = Stage(args.name, args.out, args.report, time.monotonic() + args.seconds - margin(args.seconds),
                  args.dry_run, args.model)
    try:
        importlib.import_module(f"kvlab.bench.gpu.stage_{args.name}").run(stage)
    except Exception as error:  # anything the stage did not catch itself is one more failed check
        traceback.print_exc(file=sys.stdout)
        stage.record("uncaught error", "failed", f"{type(error).__name__}: {str(error)[:500]}")
    return 1 if stage.failed else 0


if __name__ == "__main__":
    sys.exit(main())
