"""The ``kvlab`` command (also ``python -m kvlab``): ``kvlab --help`` lists its commands.

What kvlab's commands share lives beside it: ``kvlab.cli.commands`` (a command with subcommands, also
``python -m kvlab.bench``) and ``kvlab.cli.options`` (option types: ``kvlab study``, ``kvlab fleet``, ``kvlab size``).
"""

import argparse
import sys

from kvlab.cli.commands import dispatch

COMMANDS = {
    "study": ("replay traces through the block manager and report prefix-cache hit rates (the main job)",
              "kvlab.studies.cli:main"),
    "fleet": ("route a trace across replicas (KV-event routers) and report hit rates, load imbalance and TTFT",
              "kvlab.studies.fleet_cli:main"),
    "validate": ("reproduce published prefix-cache figures (Dynamo, Mooncake, PagedAttention, vLLM's hit laws) "
                 "beside kvlab's, with the gap and why they differ", "kvlab.studies.validate:main"),
    "size": ("KV cache bytes per token and per block, and the blocks, tokens and concurrent requests a GPU holds",
             "kvlab.sizing.cli:main"),
    "course": ("the course's homework edition: export a student or instructor copy, grade a class's notebooks",
               "kvlab.course.homework:main"),
    "info": ("which kernel mode is active (GPU or Triton interpreter), with versions", "kvlab.cli:info"),
    "bench": ("benchmarks: blocks (block manager), kernels (GPU), engine (vs Hugging Face generate)",
              "kvlab.cli:bench"),
}


def main(argv=None) -> int:
    return dispatch(sys.argv[1:] if argv is None else list(argv), prog="kvlab", commands=COMMANDS,
                    description="kvlab: paged KV caches for teaching and research (a vLLM-style block manager, "
                                "Triton kernels, trace studies, a small engine).")


def info(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="kvlab info", description="Print which kernel mode is active (GPU or Triton "
                                                           "interpreter), with versions.").parse_args(argv)
    import kvlab

    print(kvlab.report())
    return 0


def bench(argv: list[str]) -> int:
    from kvlab.bench.__main__ import main as bench_main

    return bench_main(argv, prog="kvlab bench")

