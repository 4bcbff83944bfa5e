"""What every puzzle's ``check`` shares: run the learner's code on random cases, stop at the first one it gets
wrong, and say so in plain words.

A puzzle's check builds its cases from a seed (the same seed, the same cases), each with kvlab's own answer, and
hands them to ``grade``. A ``Case`` knows how to call the learner's code (``run``), and how to judge what came
back (``judge``: None when right, else a sentence saying what is wrong). ``grade`` returns a ``Report``; with
``strict=True`` it raises ``PuzzleNotSolvedError`` with the same message instead of returning a failed one.
"""

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Optional

from kvlab.errors import InvalidArgumentError, KvlabError, PuzzleNotSolvedError
from kvlab.validation import check_int

NOT_YET = ("the stub still raises NotImplementedError: replace its body with your solution "
           "(the spec is in the puzzle's docstring)")


class Case(NamedTuple):
    inputs: str                               # the case in words: what the learner's code was given
    run: Callable[[Any], Any]                 # run(learner) -> what the learner's code answered
    judge: Callable[[Any], Optional[str]]     # judge(got) -> None if right, else what is wrong


@dataclass(frozen=True)
class Report:
    """The outcome of a check: ``passed`` (also the report's truth value), how many cases ran, and, when a case
    failed, ``problem``: which case, its inputs, and what was expected against what came back."""
    puzzle: str
    num_passed: int
    problem: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.problem is None

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"{self.puzzle}: solved, all {self.num_passed} random cases pass."
        return f"{self.puzzle}: not yet: {self.problem}"

    __repr__ = __str__  # a notebook cell ending in check(...) shows the sentence


def equal(expected, explain: Callable[[Any], str] = None) -> Callable[[Any], Optional[str]]:
    """A judge that wants ``expected`` exactly; ``explain(got)`` (optional) adds why the two differ."""
    def judge(got):
        if got == expected:
            return None
        why = explain(got) if explain is not None else ""
        return f"expected {expected!r}, got {got!r}" + (f": {why}" if why else "")
    return judge


def seeded(seed, num_cases) -> random.Random:
    """The random source of a check's cases, once its arguments are checked."""
    check_int("num_cases", num_cases, 1)
    return random.Random(check_int("seed", seed))


def grade(puzzle: str, learner, cases: Iterable[Case], *, strict: bool = False) -> Report:
    """Run ``learner`` on ``cases`` in order until one fails; the Report names the first failure."""
    if not callable(learner):
        raise InvalidArgumentError(f"check takes your function (or class) itself, got {learner!r}")
    num_passed = 0
    for number, case in enumerate(cases, 1):
        problem = _problem(number, case, learner)
        if problem is not None:
            return _finish(Report(puzzle, num_passed, problem), strict)
        num_passed += 1
    return _finish(Report(puzzle, num_passed), strict)


def _problem(number: int, case: Case, learner) -> Optional[str]:
    try:
        got = case.run(learner)
    except Exception as error:  # the learner's bug, whatever it is, becomes the report's message
        cause = _root_cause(error)
        if isinstance(cause, NotImplementedError) and not isinstance(cause, KvlabError):  # not kvlab refusing
            return NOT_YET
        return f"case {number} ({case.inputs}): your code raised {type(cause).__name__}: {cause}"
    verdict = case.judge(got)
    return None if verdict is None else f"case {number} ({case.inputs}): {verdict}"


def _root_cause(error: BaseException) -> BaseException:
    """The learner's own exception: kvlab wraps one a user policy raises (EvictionPolicyError, raised from it)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _finish(report: Report, strict: bool) -> Report:
    if strict and not report.passed:
        raise PuzzleNotSolvedError(str(report))
    return report
