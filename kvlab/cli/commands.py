"""Commands with subcommands (``kvlab``, ``python -m kvlab.bench``): the first word picks a function that
parses the rest with its own parser, ``--help`` included.

Anything else, no word, ``--help`` or an unknown word, goes to an argparse parser that lists the commands:
help exits 0, a missing or unknown command prints one error line naming it and the choices and exits 2.
Commands are named as ``"module:function"`` strings and imported only when chosen: ``kvlab study`` should
not wait for torch, nor ``kvlab --help`` for anything.
"""

import argparse
import importlib
import os
import select
import signal
import sys


def dispatch(argv: list[str], *, prog: str, description: str, commands: dict[str, tuple[str, str]]) -> int:
    """``commands``: name -> (one-line help, ``"module:function"``); the function takes the arguments after
    the name and returns the exit status."""
    if not argv or argv[0] not in commands:
        parser = argparse.ArgumentParser(prog=prog, description=description,
                                         epilog=f"Run `{prog} COMMAND --help` for a command's options.")
        choices = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
        for command, (summary, _) in commands.items():
            choices.add_parser(command, help=summary, add_help=False)
        parser.parse_args(argv)  # exits: the help (0), or an error naming the missing or unknown command (2)
    module, function = commands[argv[0]][1].split(":")
    try:
        status = getattr(importlib.import_module(module), function)(argv[1:])
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's own flush at exit
        return status
    except BrokenPipeError:
        if not _reader_left(sys.stdout):
            raise  # another pipe or socket broke (a Dask worker's): an error to report
        # The reader stopped reading (``kvlab size ... | head -1``): end quietly, as command-line tools do. stdout
        # is pointed at devnull so the flush at exit cannot fail again (Python's docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a shell reports for a command the broken pipe stopped


def _reader_left(stream) -> bool:
    """Whether ``stream`` is a pipe whose reading end was closed: polling its writing end reports an error."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor (a captured stream), or no poll here
        return False
