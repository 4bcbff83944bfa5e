"""What every puzzle's ``check`` shares: run the learner's code on random cases, stop at the first one it gets
wrong, and say so in plain words.

A puzzle's check builds its cases from a seed (the same seed, the same cases), each with kvlab's own answer, and
hands them to ``grade``. A ``Case`` knows how to call the learner's code (``run``), and how to judge what came
back (``judge``: None when right, else a sentence saying what is wrong). ``grade`` returns a ``Report``; with
``strict=True`` it raises ``PuzzleNotSolvedError`` with the same message instead of returning a failed one.

The learner's code runs through ``call_learner`` (``kvlab.course.answer`` compares through it too), so that
whatever the code does, the grader comes back with a verdict:

* **Time.** Each call into it (running a case's code, then judging what came back; ``answer``'s comparison)
  may take ``TIME_LIMIT_S`` seconds (None: no limit, e.g. to step through your code in a debugger). In the main
  thread on POSIX (a Jupyter kernel; pytest on Linux or macOS) a ``SIGALRM`` timer interrupts the code, and
  ticks again every ``RETRY_S`` until it has stopped (kvlab may call it again while undoing, as a manager's
  rollback does); the previous SIGALRM handler and timer come back after the call, an earlier deadline of
  theirs still holding. Elsewhere (another thread; Windows) the code runs in a daemon thread, waited for at
  most the limit, then stopped with an asynchronous exception (CPython). Either way, code inside one long C
  call stops only when the call returns, and code that swallows every exception (a bare ``except:`` in a
  loop) cannot be stopped.
* **Exits and interrupts.** ``SystemExit`` (``sys.exit()`` would end the notebook's kernel), a
  ``KeyboardInterrupt`` the code raises itself, and any other exception are a failed case, not a crash. A real
  interrupt (Ctrl-C, Jupyter's stop button: SIGINT) still stops the check: in the main thread a SIGINT handler,
  installed for the call, notes that it came and hands it to the previous handler; elsewhere it reaches the
  main thread, not the learner's code.
* **NumPy.** Values come back as the Python numbers and lists they hold (``as_python``: NumPy scalars and
  arrays, pandas Series), and a bool never passes for a number (``same``): ``True == 1`` in Python, but True is
  never a slot, a block or a replica's index.
"""

import ctypes
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Optional

import numpy as np

from kvlab.errors import InvalidArgumentError, KvlabError, PuzzleNotSolvedError
from kvlab.validation import check_int, check_number

NOT_YET = ("the stub still raises NotImplementedError: replace its body with your solution "
           "(the spec is in the puzzle's docstring)")
TIME_LIMIT_S: Optional[float] = 10.0  # per call into the learner's code; the solutions take milliseconds
RETRY_S = 0.05                         # how often a call past its limit is interrupted again
WORKER_NAME = "kvlab: learner code"    # the thread running the learner's code off the main thread


class Case(NamedTuple):
    inputs: str                               # the case in words: what the learner's code was given
    run: Callable[[Any], Any]                 # run(learner) -> what the learner's code answered
    judge: Callable[[Any], Optional[str]]     # judge(got) -> None if right, else what is wrong


@dataclass(frozen=True)
class Report:
    """The outcome of a check: ``passed`` (also the report's truth value), how many cases passed out of the
    ``num_cases`` it runs, and, when a case failed, ``problem``: which case, its inputs, and what was expected
    against what came back."""
    puzzle: str
    num_passed: int
    problem: Optional[str] = None
    num_cases: Optional[int] = None

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
    """A judge that wants ``expected`` exactly (``same``); ``explain(got)`` (optional) adds why the two differ."""
    def judge(got):
        if same(got, expected):
            return None
        why = explain(got) if explain is not None else ""
        return f"expected {expected!r}, got {got!r}" + (f": {why}" if why else "")
    return judge


def same(got, expected) -> bool:
    """Whether ``got`` is ``expected``: equal, and a bool only where a bool is expected (lists and tuples element
    by element), since ``True == 1`` in Python."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if type(got) in (list, tuple) and type(got) is type(expected):
        return len(got) == len(expected) and all(same(g, e) for g, e in zip(got, expected))
    return bool(got == expected)


def not_an_int(values) -> Optional[str]:
    """What is wrong when ``values`` (a learner's list) holds something other than ints, else None."""
    for value in values:
        if isinstance(value, bool):
            return f"{value!r} is a bool, not an int"
        if not isinstance(value, int):
            return f"{value!r} is a {type(value).__name__}, not an int"
    return None


def seeded(seed, num_cases) -> random.Random:
    """The random source of a check's cases, once its arguments are checked."""
    check_int("num_cases", num_cases, 1)
    return random.Random(check_int("seed", seed))


def numbering_hash_fn(rng: random.Random):
    """A block ``hash_fn(parent, tokens)`` for a case: a new number for each (parent, tokens) it has not seen,
    so no two blocks collide (the block manager would verify the bytes and refuse a hit the learner's rule, which
    sees hashes only, would take) and the numbers read well in a report: five digits, never a block's index."""
    numbers, start, step = {}, rng.randrange(10_000, 20_000), rng.randrange(7, 100)
    return lambda parent, tokens: numbers.setdefault((parent, tuple(tokens)), start + step * len(numbers))


def grade(puzzle: str, learner, cases: Iterable[Case], *, num_cases: Optional[int] = None,
          strict: bool = False) -> Report:
    """Run ``learner`` on ``cases`` (``num_cases`` of them, None: unsaid) in order until one fails; the Report
    names the first failure. A class being graded (``$KVLAB_GRADES``: ``record_grade``) gets the report too."""
    if not callable(learner):
        raise InvalidArgumentError(f"check takes your function (or class) itself, got {learner!r}")
    num_passed, report = 0, None
    for number, case in enumerate(cases, 1):
        problem = _problem(number, case, learner)
        if problem is not None:
            report = Report(puzzle, num_passed, problem, num_cases)
            break
        num_passed += 1
    if report is None:
        report = Report(puzzle, num_passed, None, num_cases)
    record_grade(kind="puzzle", name=puzzle, passed=report.passed, message=str(report))
    return _finish(report, strict)


#: When set (``kvlab course grade`` sets it for each notebook it runs), the file every graded exercise and
#: puzzle check appends one JSON line to.
GRADES_ENV = "KVLAB_GRADES"


def record_grade(**entry) -> None:
    """Append ``entry`` as a JSON line to the file named by ``$KVLAB_GRADES``; nothing when it is unset."""
    path = os.environ.get(GRADES_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(entry) + "\n")


def _problem(number: int, case: Case, learner) -> Optional[str]:
    try:
        got = call_learner(lambda: as_python(case.run(learner)))
    except LearnerCodeFailed as failed:  # the learner's bug, whatever it is, becomes the report's message
        if isinstance(failed.error, NotImplementedError) and not isinstance(failed.error, KvlabError):
            return NOT_YET  # the stub, not kvlab refusing
        return f"case {number} ({case.inputs}): your code {failed}"
    try:  # judging runs the learner's code too: the __eq__ of what it returned
        verdict = call_learner(lambda: case.judge(got))
    except LearnerCodeFailed as failed:
        return (f"case {number} ({case.inputs}): your code returned {describe(got)}, which kvlab could not compare "
                f"with the answer: the comparison {failed}")
    return None if verdict is None else f"case {number} ({case.inputs}): {verdict}"


def _finish(report: Report, strict: bool) -> Report:
    if strict and not report.passed:
        raise PuzzleNotSolvedError(str(report))
    return report


# ---- calling the learner's code safely (the module docstring says how and why) -------------------------------
class LearnerCodeFailed(Exception):
    """The learner's code did not return. The message completes "your code ..."; ``error`` is what the code
    raised (the root cause of what reached the grader), None when it ran out of time."""

    def __init__(self, message: str, error: Optional[BaseException]):
        super().__init__(message)
        self.error = error


class _OutOfTime(BaseException):
    """Raised into the learner's code when its time is up: not an Exception, so ``except Exception`` in the
    learner's code or in kvlab (a manager wrapping what a policy raised) lets it through."""


def call_learner(call: Callable[[], Any]) -> Any:
    """``call()``, a call into the learner's code, within ``TIME_LIMIT_S``: what it returns, or
    ``LearnerCodeFailed`` saying what went wrong when it raised anything (SystemExit, a KeyboardInterrupt of its
    own) or ran out of time. A real interrupt (SIGINT) is raised as KeyboardInterrupt, never contained."""
    limit = TIME_LIMIT_S
    if limit is not None:
        check_number("kvlab.puzzles.grading.TIME_LIMIT_S (None: no limit)", limit, 0, min_open=True)
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread and hasattr(signal, "setitimer"):
        value, error = _call_with_signals(call, limit)
    else:
        value, error = _call_in_thread(call, limit)
    if error is None:
        return value
    cause = _root_cause(error)
    if isinstance(cause, _OutOfTime):
        raise LearnerCodeFailed(f"ran past the time limit of {limit:g} s (kvlab.puzzles.grading.TIME_LIMIT_S): "
                                "does it loop forever?", None)
    if isinstance(cause, SystemExit):
        message = (f"raised SystemExit({cause.code!r}) (sys.exit), which would stop the notebook's kernel: "
                   "return your answer instead")
    elif isinstance(cause, KeyboardInterrupt):
        message = "raised KeyboardInterrupt itself (nobody interrupted the check)"
    else:
        message = f"raised {type(cause).__name__}: {_text(cause)}"
    raise LearnerCodeFailed(message, cause)


def as_python(value):
    """``value`` with NumPy scalars and arrays and pandas Series replaced by the Python numbers and lists they
    hold, inside lists and tuples too (``np.int64(3)`` -> 3, ``np.True_`` -> True, an array -> nested lists)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    pandas = sys.modules.get("pandas")  # a Series exists only once pandas is imported: no need to import it
    if pandas is not None and isinstance(value, pandas.Series):
        return value.tolist()
    if type(value) in (list, tuple):
        return type(value)(as_python(item) for item in value)
    return value


def describe(value) -> str:
    """``repr(value)``, or what the value is when its repr fails (a learner's class)."""
    try:
        return call_learner(lambda: repr(value))
    except LearnerCodeFailed as failed:
        return f"a {type(value).__name__} (whose repr {failed})"


def _root_cause(error: BaseException) -> BaseException:
    """The learner's own exception: kvlab wraps one a user policy raises (EvictionPolicyError, raised from it)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _text(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # a learner's exception class whose __str__ fails
        return "(its message cannot be shown)"


def _run(call):
    """``(what call() returned, None)`` or ``(None, what it raised)``."""
    try:
        return call(), None
    except BaseException as error:  # contained, or re-raised by the caller when it is a real interrupt
        return None, error


def _call_with_signals(call, limit):
    """In the main thread: SIGALRM bounds the call, a SIGINT handler tells a real interrupt from the code's own."""
    interrupted = False
    previous_interrupt = signal.getsignal(signal.SIGINT)

    def ours(frame) -> bool:  # the grader's own bookkeeping, never interrupted: it restores the handlers
        return frame is not None and frame.f_code.co_filename == __file__

    def on_alarm(signum, frame):
        if not ours(frame):
            raise _OutOfTime

    def on_interrupt(signum, frame):
        nonlocal interrupted
        if previous_interrupt is signal.SIG_IGN:
            return
        interrupted = True  # raised below once the handlers are back, if it lands in the grader's own code
        if not ours(frame):
            if callable(previous_interrupt):
                previous_interrupt(signum, frame)  # as before the call: KeyboardInterrupt
            else:
                raise KeyboardInterrupt  # SIG_DFL, or a handler not set from Python

    signal.signal(signal.SIGINT, on_interrupt)
    if limit is not None:
        previous_alarm = signal.signal(signal.SIGALRM, on_alarm)
        previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, limit, RETRY_S)
        if previous_delay:  # someone's timer was running: its deadline, if earlier, still holds
            signal.setitimer(signal.ITIMER_REAL, min(limit, previous_delay), RETRY_S)
        started = time.monotonic()
    try:
        value, error = _run(call)
    finally:
        if limit is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_alarm is None else previous_alarm)
            if previous_delay:
                left = previous_delay - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), previous_interval)
        signal.signal(signal.SIGINT, signal.default_int_handler if previous_interrupt is None
                      else previous_interrupt)
    if interrupted:
        raise error if isinstance(error, KeyboardInterrupt) else KeyboardInterrupt
    return value, error


def _call_in_thread(call, limit):
    """Off the main thread or without SIGALRM: run the call in a daemon thread and wait at most ``limit``."""
    outcome = []

    def work():
        try:
            outcome.append(_run(call))
        except _OutOfTime:  # stopped just as the call ended: the waiting side has given up on it
            pass

    worker = threading.Thread(target=work, name=WORKER_NAME, daemon=True)
    worker.start()
    try:
        worker.join(limit)
    finally:  # out of time, or a real interrupt came while waiting
        if worker.is_alive():
            _stop(worker)
    return outcome[0] if outcome else (None, _OutOfTime())


def _stop(worker: threading.Thread, tries: int = 20) -> None:
    """Raise _OutOfTime in ``worker`` (it lands at the thread's next bytecode), again while it keeps running
    (kvlab may call the code again while undoing); a thread that swallows it every time runs on, as a daemon."""
    set_async_exc = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if set_async_exc is None:  # not CPython
        return
    for _ in range(tries):
        set_async_exc(ctypes.c_ulong(worker.ident), ctypes.py_object(_OutOfTime))
        worker.join(RETRY_S)
        if not worker.is_alive():
            return
