"""Exercises that grade themselves: a learner edits a value, the notebook's own run computes the truth.

A notebook must run top to bottom in CI as committed, with every exercise still unanswered, so ``answer``
never raises on the learner's input: it prints "not answered yet", "right" or what is wrong, and returns
``None``, ``True`` or ``False``. The truth comes from the notebook's machinery, never from a constant typed
next to the question, so a changed knob changes the truth with it.
"""

import math

from kvlab.errors import InvalidArgumentError


def _matches(yours, truth, rel_tol: float) -> bool:
    if isinstance(truth, bool) or isinstance(yours, bool):  # True == 1 must not pass for a count
        return type(yours) is type(truth) and yours == truth
    if isinstance(truth, (int, float)) and isinstance(yours, (int, float)):
        return math.isclose(yours, truth, rel_tol=rel_tol, abs_tol=0 if rel_tol == 0 else 1e-12)
    if isinstance(truth, str) and isinstance(yours, str):
        return yours.strip().lower() == truth.strip().lower()
    return yours == truth


def answer(yours, truth, why: str, *, rel_tol: float = 0.0) -> bool | None:
    """Grade ``yours`` against ``truth`` and say why the truth is what it is.

    ``yours``: the learner's value; ``None`` means not answered yet (the committed state). ``truth``: what
    the notebook measured. ``why``: one sentence, printed either way, that explains the truth. ``rel_tol``:
    relative tolerance for numbers (0: exact). Strings compare case-insensitively. Returns ``None`` when
    unanswered, else whether the answer is right.
    """
    if not isinstance(why, str) or not why.strip():
        raise InvalidArgumentError("answer(why=...) must explain the truth in a non-empty sentence")
    if not rel_tol >= 0:
        raise InvalidArgumentError(f"rel_tol must be a number >= 0, got {rel_tol!r}")
    if yours is None:
        print("Not answered yet: replace None with your prediction, then run this cell again.")
        return None
    if _matches(yours, truth, rel_tol):
        print(f"Right: {truth!r}. {why}")
        return True
    print(f"Not quite: you said {yours!r}, the run gives {truth!r}. {why}")
    return False
