"""The studies' option types (``kvlab study``, ``kvlab fleet``) and the check of their ``--out``, built on the
option types every kvlab command shares (``kvlab.cli.options``).

Each type takes the option's text and returns its value, or raises ValueError (kvlab's InvalidArgumentError
is one) with a message that reads well after argparse's "argument --name:"; ``option`` turns it into the
ArgumentTypeError argparse prints.
"""

import argparse
import tempfile
from pathlib import Path

from kvlab.blocks.sequence import check_block_size
from kvlab.cli.options import option, whole_number
from kvlab.validation import check_directory, check_int, check_number


def comma_list(parse):
    def parse_list(text: str) -> list:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise ValueError(f"expected a comma-separated list without empty items, got {text!r}")
        values = [parse(item) for item in items]
        # A repeated value would replay the same configuration twice and print duplicate rows.
        repeated = [item for item, value in zip(items, values) if values.count(value) > 1]
        if repeated:
            raise ValueError(f"{repeated[0]!r} is given more than once in {text!r}; give each value once")
        return values
    return option(parse_list)


def block_size_number(text: str) -> int:
    return check_block_size(whole_number(text))


def count_of(name: str):
    def parse_count(text: str) -> int:
        return check_int(name, whole_number(text), 1)
    return parse_count


def retries(text: str) -> int:
    """``--retries``: how many times a failed replay is tried again (0: never)."""
    return check_int("retries", whole_number(text), 0)


def positive_number(name: str):
    def parse_positive(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        return check_number(name, value, 0, min_open=True)  # inf or NaN would stall a clock or a wait
    return parse_positive


def directory(text: str) -> Path:
    try:  # not through option(): a path is not stripped, it may end in a space
        return check_directory("out", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_out(out: Path, names=("study.csv", "study.png")) -> str | None:
    """Why ``out`` cannot take the files ``names`` (study.csv and study.png), or None: checked before the
    replays, not after, and without leaving anything behind (a study refused for bad input leaves no
    directory): ``out`` must take new files, or, when it does not exist yet, the nearest existing directory on
    the way to it must take a new directory. Some file systems refuse with odd reasons (/proc says "No such
    file or directory"), so the message says what was tried."""
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory"
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot write in {out}: Not a directory ({existing} is a file)"
    try:
        if existing == out:
            with tempfile.TemporaryFile(dir=out):
                pass
        else:
            with tempfile.TemporaryDirectory(dir=existing):
                pass
    except OSError as e:
        if existing == out:
            return f"cannot create files in {out} ({e.strerror or e})"
        return f"cannot create the directory {out}: {existing} does not take new directories ({e.strerror or e})"
    taken = [name for name in names if (out / name).is_dir()]
    return f"{out / taken[0]} is a directory" if taken else None
