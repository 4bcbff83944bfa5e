"""Exercises that grade themselves: a learner edits a value, the notebook's own run computes the truth.

A notebook must run top to bottom in CI as committed, with every exercise still unanswered, so ``answer``
never raises on the learner's input: it prints "not answered yet" (naming the variable to set), "right" or
what is wrong, and returns a ``Verdict`` (``.right``: ``None``, ``True`` or ``False``), which shows nothing as
a cell's last value (the printed line said it all). The truth comes from the notebook's machinery, never from
a constant typed next to the question, so a changed knob changes the truth with it.

Two editions (``kvlab course export``): in the instructor's (the default) a wrong answer is told the truth and
why at once; in the student's (``student_edition()``, which the exported notebooks call first) it gets a hint
(higher or lower, the shape, "not that word"), and ``reveal()`` shows the truth when the learner asks. Under
``kvlab course grade`` every verdict is also recorded for the class's report (``record_grade``).

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
import os
from fractions import Fraction

from kvlab.errors import InvalidArgumentError
from kvlab.puzzles.grading import GRADES_ENV, LearnerCodeFailed, as_python, call_learner, describe, record_grade
from kvlab.validation import check_number

ABS_TOL = 1e-12  # with a tolerance, numbers this close to 0 match 0

_student = False  # the student edition: hints first, the truth on request (``reveal``)
_withheld: dict = {}  # exercise -> (its truth, why), for ``reveal``: answered wrong in the student edition


def student_edition() -> None:
    """From now on a wrong answer gets a hint, not the truth; ``reveal()`` shows the truth on request (the
    student edition's notebooks call this first)."""
    global _student
    _student = True


def reveal(name: str | None = None) -> None:
    """Print the truth and why of the exercises answered wrong so far (``name``: only that one, e.g.
    ``"PREDICTED_BLOCKS"``)."""
    shown = {name: _withheld[name]} if name in _withheld else {} if name is not None else _withheld
    if not shown:
        print(f"No wrong answer to reveal{' for ' + name if name is not None else ''} yet: answer first.")
    for exercise, (truth, why) in shown.items():
        print(f"{exercise}: the run gives {describe(truth)}. {why}")


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
    # The variable's name is read from the caller's source only where a message or a grade needs it.
    needs_name = yours is None or _student or os.environ.get(GRADES_ENV)
    name = _first_argument(inspect.currentframe().f_back) if needs_name else None
    if yours is None:
        print(f"Not answered yet: set {name or 'your prediction'} (now None) to what you predict, then run this "
              "cell again.")
        record_grade(kind="exercise", name=name or "an exercise", passed=False, message="not answered")
        return Verdict(None)
    yours, truth = as_python(yours), as_python(truth)
    try:
        right = call_learner(lambda: _matches(yours, truth, rel_tol))
        hint = "" if right else _shape_hint(yours, truth)
    except LearnerCodeFailed as failed:
        right, hint = False, f" (the comparison {failed})"
    if right:
        message = f"Right: {describe(truth)}. {why}"
    elif _student:
        _withheld[name or "your last answer"] = (truth, why)
        try:
            hint = hint or call_learner(lambda: _direction_hint(yours, truth))
        except LearnerCodeFailed:
            hint = " (not that one)"
        message = (f"Not quite: you said {describe(yours)}{hint}. Think again, "
                   f"or run kvlab.course.reveal({name or ''!r}) to see the answer.")
    else:
        message = f"Not quite: you said {describe(yours)}, the run gives {describe(truth)}{hint}. {why}"
    print(message)
    record_grade(kind="exercise", name=name or "an exercise", passed=bool(right),
                 message=message if right or not _student else f"you said {describe(yours)}")
    return Verdict(bool(right))


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


def _direction_hint(yours, truth) -> str:
    """The student edition's hint for a value of the right shape: which way a number is off, else that a
    word or a value is not it."""
    if isinstance(truth, (int, float)) and isinstance(yours, (int, float)) and not isinstance(truth, bool) \
            and not isinstance(yours, bool) and yours == yours and truth == truth:
        return f" (the run's value is {'higher' if truth > yours else 'lower'})"
    if isinstance(truth, (list, tuple)) and isinstance(yours, (list, tuple)):
        first = next(i for i, (y, t) in enumerate(zip(yours, truth)) if not _matches(y, t, 0.0))
        return f" (element {first} of your list is not the run's)"
    return " (not that one)"


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
