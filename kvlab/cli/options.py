"""Option types shared by kvlab's commands (``kvlab study``, ``kvlab fleet``, ``kvlab size``).

Each parser raises ValueError (kvlab's InvalidArgumentError is one) with a message that reads well after
argparse's "argument --name:"; ``option`` turns it into the ArgumentTypeError argparse prints as one line.
"""

import argparse


def option(parse):
    def checked(text: str):
        try:
            return parse(text.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return checked


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None
