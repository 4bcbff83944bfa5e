"""Exercises that grade themselves: a learner edits a value, the notebook's own run computes the truth.

A notebook must run top to bottom in CI as committed, with every exercise still unanswered, so ``answer``
never raises on the learner's input: it prints "not answered yet" (naming the variable to set), "right" or
what is wrong, and returns a ``Verdict`` (``.right``: ``None``, ``True`` or ``False``), which shows nothing as
a cell's last value (the printed line said it all). The truth comes from the notebook's machinery, never from
a constant typed next to the question, so a changed knob changes the truth with it.

How two values compare (both sides alike, so a truth computed with NumPy or pandas grades as it reads):

* NumPy scalars are the Python numbers they hold (``np.True_`` is True, ``np.int64(3)`` is 3);
* a bool matches only a bool: ``True == 1`` in Python, but True is no count;
* numbers match within ``rel_tol``, exactly (as fractions, so ``10**20 + 1`` is not ``10**20``, and an int too
  large for a float is still compared) when it is 0;
* strings match ignoring case and surrounding spaces;
* sequences (lists, tuples, NumPy arrays, pandas Series by their values in order) match element by element
  by these same rules, with the same shape; when one side is a sequence and the other a single value, or the
  shapes differ, the message says so;
* anything else by ``==``. The comparison runs as the puzzles run the learner's code
  (``kvlab.puzzles.grading.call_learner``): an ``__eq__`` that raises, loops or exits is a wrong answer that
  says what happened, not a crash.
"""

import ast
import inspect
import math
from fractions import Fraction

from kvlab.errors import InvalidArgumentError
from kvlab.puzzles.grading import LearnerCodeFailed, as_python, call_learner, describe
from kvlab.validation import check_number

ABS_TOL = 1e-12  # with a tolerance, numbers this close to 0 match 0


class Verdict:
    """What ``answer`` decided: ``right`` is None (not answered yet), True or False; ``bool(verdict)`` is
    whether it is right. A notebook cell ending with ``answer(...)`` shows nothing more than the printed line."""
    __slots__ = ("right",)

    def __init__(self, right: bool | None):
        self.right = right

    def __bool__(self) -> bool:
        return bool(self.right)

    def __repr__(self) -> str:
        return f"Verdict(right={self.right})"

    def _ipython_display_(self) -> None:
        """IPython calls this instead of printing ``Out[n]: ...``: answer printed the verdict already."""


def answer(yours, truth, why: str, *, rel_tol: float = 0.0) -> Verdict:
    """Grade ``yours`` against ``truth`` and say why the truth is what it is.

    ``yours``: the learner's value; ``None`` means not answered yet (the committed state). ``truth``: what
    the notebook measured. ``why``: one sentence, printed either way, that explains the truth. ``rel_tol``:
    relative tolerance for numbers (a finite number >= 0; 0: exact). How values compare: the module
    docstring. Returns the ``Verdict``.
    """
    if not isinstance(why, str) or not why.strip():
        raise InvalidArgumentError("answer(why=...) must explain the truth in a non-empty sentence")
    rel_tol = check_number("rel_tol (the relative tolerance; 0: exact)", rel_tol, 0)
    why = why.strip()
    why = why[0].upper() + why[1:]  # it follows a full stop
    if yours is None:
        name = _first_argument(inspect.currentframe().f_back)
        print(f"Not answered yet: set {name or 'your prediction'} (now None) to what you predict, then run this "
              "cell again.")
        return Verdict(None)
    yours, truth = as_python(yours), as_python(truth)
    try:
        right = call_learner(lambda: _matches(yours, truth, rel_tol))
        hint = "" if right else _shape_hint(yours, truth)
    except LearnerCodeFailed as failed:
        right, hint = False, f" (the comparison {failed})"
    if right:
        print(f"Right: {describe(truth)}. {why}")
        return Verdict(True)
    print(f"Not quite: you said {describe(yours)}, the run gives {describe(truth)}{hint}. {why}")
    return Verdict(False)


def _first_argument(frame) -> str | None:
    """The source text of the first argument of the ``answer(...)`` call running on ``frame``'s current line
    (a notebook's ``PREDICTED_...`` variable), or None where the source cannot be read (then the message
    says "your prediction"). Jupyter keeps each cell's source where ``inspect`` finds it."""
    try:
        source = "".join(inspect.findsource(frame)[0])
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and node.args and node.lineno <= frame.f_lineno <= node.end_lineno
                    and getattr(node.func, "id", getattr(node.func, "attr", None)) == "answer"):
                return ast.get_source_segment(source, node.args[0])
    except (OSError, TypeError, SyntaxError):
        pass
    return None


def _matches(yours, truth, rel_tol: float) -> bool:
    """``yours`` against ``truth``, both Python values (``as_python``'s), by the module docstring's rules."""
    if isinstance(truth, bool) or isinstance(yours, bool):  # True == 1 must not pass for a count
        return type(yours) is type(truth) and yours == truth
    if isinstance(truth, (int, float)) and isinstance(yours, (int, float)):
        return _close(yours, truth, rel_tol)
    if isinstance(truth, str) and isinstance(yours, str):
        return yours.strip().lower() == truth.strip().lower()
    if isinstance(truth, (list, tuple)) or isinstance(yours, (list, tuple)):
        return (isinstance(truth, (list, tuple)) and isinstance(yours, (list, tuple)) and len(yours) == len(truth)
                and all(_matches(y, t, rel_tol) for y, t in zip(yours, truth)))
    return bool(yours == truth)


def _close(yours, truth, rel_tol: float) -> bool:
    if not all(math.isfinite(x) for x in (yours, truth) if isinstance(x, float)):
        return yours == truth  # inf matches only itself, nan nothing (as math.isclose says)
    # Fractions, not floats: exact for ints of any size (a float has 53 bits: 10**20 + 1 would be 10**20)
    y, t = Fraction(yours), Fraction(truth)
    return abs(y - t) <= max(Fraction(rel_tol) * max(abs(y), abs(t)), Fraction(ABS_TOL) if rel_tol else 0)


def _shape(value) -> tuple:
    """The lengths along a sequence's first elements: () for a single value."""
    shape = []
    while isinstance(value, (list, tuple)):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return tuple(shape)


def _shape_hint(yours, truth) -> str:
    """Why a wrong answer cannot be right whatever its numbers: one value for many, or another shape."""
    yours_shape, truth_shape = _shape(yours), _shape(truth)
    if yours_shape == truth_shape:
        return ""
    if not truth_shape:
        return f" (the run gives one value; you gave {yours_shape[0]})"
    if not yours_shape:
        return f" (the run gives {truth_shape[0]} values, not one: answer with a list of them)"
    if len(yours_shape) == len(truth_shape) == 1:
        return f" (you gave {yours_shape[0]} values, the run gives {truth_shape[0]})"
    return f" (your answer has shape {yours_shape}, the run's has shape {truth_shape})"
