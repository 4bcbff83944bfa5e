"""The puzzles grade themselves (kvlab.puzzles): every solution passes its check, every untouched stub fails it
saying "not yet", and plausible wrong solutions fail with a report that names the mistake."""

import inspect
import linecache
import re
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import InvalidArgumentError, KvlabError, PuzzleNotSolvedError
from kvlab.puzzles import PUZZLES, Report, grading, puzzle
from kvlab.puzzles.grading import NOT_YET, WORKER_NAME, Case, equal, grade
from wrong_solutions import WRONG

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
BY_NAME = {p.name: p for p in PUZZLES}
WRONG_BY_NAME = {wrong.__name__: wrong for _, wrong, _ in WRONG}


@pytest.mark.parametrize("p", PUZZLES, ids=lambda p: p.name)
def test_every_solution_passes_its_check(p):
    report = p.module.check(p.solution(), strict=True)
    assert report.passed and report and report.num_passed > 0
    assert str(report) == f"{p.name}: solved, all {report.num_passed} random cases pass."


@pytest.mark.parametrize("p", PUZZLES, ids=lambda p: p.name)
def test_every_solution_passes_on_other_seeds_too(p):
    for seed in (1, 2):
        assert p.module.check(p.solution(), seed=seed).passed


@pytest.mark.parametrize("p", PUZZLES, ids=lambda p: p.name)
def test_every_untouched_stub_fails_saying_not_yet(p):
    report = p.module.check(getattr(p.module, p.stub))
    assert not report.passed and not report and report.num_passed == 0
    assert str(report) == f"{p.name}: not yet: {NOT_YET}" and repr(report) == str(report)
    with pytest.raises(PuzzleNotSolvedError, match="not yet: the stub still raises NotImplementedError"):
        p.module.check(getattr(p.module, p.stub), strict=True)


@pytest.fixture
def time_limit(monkeypatch):
    """Sets the grader's time limit per call for one test: a short one, so that a loop fails fast."""
    return lambda seconds: monkeypatch.setattr(grading, "TIME_LIMIT_S", seconds)


@pytest.mark.parametrize("name, wrong, words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_a_plausible_wrong_solution_fails_with_a_report_naming_the_mistake(name, wrong, words, time_limit):
    time_limit(1.0)  # the solutions that loop forever; every real case takes milliseconds
    report = puzzle(name).module.check(wrong)
    assert not report.passed
    assert re.match(rf"{name}: not yet: case \d+ \(.+\): ", str(report)), str(report)  # the case and its inputs
    assert words in str(report), str(report)


#: Puzzles whose answer is no list of ints: an AllocStatus, a torch tensor, a Triton kernel's writes.
TENSOR_ANSWERS = ("can_allocate", "decode_attention", "prefill_attention", "split_k_merge",
                  "triton_reshape_and_cache", "triton_copy_blocks", "triton_decode_attention", "triton_split_k_decode")
#: Puzzles whose answer is a tuple of lists of ints.
TUPLE_ANSWERS = ("allocate_with_hits", "copy_on_write", "v1_step", "preemption", "tier_promotion")


def as_numpy(p):
    """``p``'s solution answering with NumPy values (arrays, np.int64) where a learner might."""
    solution = p.solution()
    if p.name in TUPLE_ANSWERS:
        return lambda *args: tuple(np.array(part, dtype=np.int64) for part in solution(*args))
    if p.name == "kv_cost_router":
        return type("NumpyRouter", (solution,), {"choose": lambda self, *args: np.int64(solution.choose(self, *args))})
    if p.name == "lru_policy":
        return type("NumpyLRU", (solution,), {"pop": lambda self: np.int64(solution.pop(self)),
                                              "__iter__": lambda self: map(np.int64, solution.__iter__(self))})
    return lambda *args: np.array(solution(*args), dtype=np.int64)


def test_numpy_answers_are_graded_as_the_numbers_they_hold():
    for p in PUZZLES:
        if p.name not in TENSOR_ANSWERS:  # an AllocStatus, a torch tensor
            assert p.module.check(as_numpy(p), strict=True).passed


def bool_for_1(value):
    return True if value == 1 else value


def with_a_bool_for_1(p):
    """``p``'s solution answering True where it means 1 (a slot, a block, a token, a copy, an index)."""
    solution = p.solution()
    if p.name == "copy_on_write":
        def plan_append(*args):
            copies, num_new_blocks = solution(*args)
            return list(map(bool_for_1, copies)), bool_for_1(num_new_blocks)
        return plan_append
    if p.name in TUPLE_ANSWERS:
        return lambda *args: tuple(list(map(bool_for_1, part)) for part in solution(*args))
    if p.name == "kv_cost_router":
        return type("BoolRouter", (solution,), {"choose": lambda self, *args: bool_for_1(solution.choose(self, *args))})
    if p.name == "lru_policy":
        return type("BoolLRU", (solution,), {"__iter__": lambda self: map(bool_for_1, solution.__iter__(self))})
    return lambda *args: list(map(bool_for_1, solution(*args)))


HASH_ANSWERS = ("block_hashes", "tier_promotion")  # answers that are hashes: none of their cases holds a 1


@pytest.mark.parametrize("p", [p for p in PUZZLES if p.name not in TENSOR_ANSWERS + HASH_ANSWERS],
                         ids=lambda p: p.name)
def test_a_bool_never_passes_for_a_number(p):
    report = p.module.check(with_a_bool_for_1(p))
    assert not report.passed
    assert re.search(r"True is a bool, not an int|got True: return a replica's index, an int", str(report))


def test_every_puzzle_has_a_wrong_solution_in_the_tests():
    assert {name for name, _, _ in WRONG} == set(BY_NAME)


def test_the_registry_lists_each_puzzle_once_with_a_notebook_to_read_first():
    assert len(BY_NAME) == len(PUZZLES) >= 6
    for p in PUZZLES:
        assert p.module.NAME == p.name and callable(getattr(p.module, p.stub))
        assert p.module.__doc__.startswith("Puzzle: ") and "Read first: notebook" in p.module.__doc__
        assert f"def {p.stub}" in p.solution_source() or f"class {p.stub}" in p.solution_source()
        for notebook in re.findall(r"\b(\d\d)[a-z]?\b", p.read_first):  # "10a": notebook 10 before its split
            assert list(NOTEBOOKS.glob(f"{notebook}*.py")), f"{p.name}: no notebook {notebook}"


def test_an_unknown_puzzle_name_says_which_exist():
    with pytest.raises(KvlabError, match="unknown puzzle 'nope'; known: slot_mapping, "):
        puzzle("nope")


def test_the_same_seed_gives_the_same_cases_and_another_seed_other_ones():
    seen = []
    check = puzzle("slot_mapping").module.check
    for seed in (0, 0, 1):
        check(lambda table, bs, start, end: seen.append((table, bs, start, end)) or [], seed=seed, num_cases=5)
    assert seen[0] == seen[1] != seen[2]


# ---- the grader itself --------------------------------------------------------------------------------------
def test_the_report_names_the_first_failing_case_its_inputs_and_both_answers():
    cases = [Case(f"x={x}", lambda fn, x=x: fn(x), equal(2 * x)) for x in range(5)]
    report = grade("double", lambda x: x + x if x < 3 else x * 3, cases)
    assert (report.passed, report.num_passed) == (False, 3)
    assert str(report) == "double: not yet: case 4 (x=3): expected 6, got 9"


def test_code_that_raises_is_reported_with_its_error_not_raised():
    report = grade("p", lambda x: [][x], [Case("x=1", lambda fn: fn(1), equal(1))])
    assert str(report) == "p: not yet: case 1 (x=1): your code raised IndexError: list index out of range"


def test_a_stub_wrapped_by_kvlab_still_reads_not_yet():
    """The manager wraps what a user eviction policy raises in EvictionPolicyError (raised from it)."""
    def wrapped(_):
        try:
            raise NotImplementedError
        except NotImplementedError as stub:
            raise KvlabError("the policy raised") from stub
    assert grade("p", print, [Case("", wrapped, equal(1))]).problem == NOT_YET


def test_strict_raises_kvlabs_own_error_with_the_reports_message():
    report = grade("p", lambda x: 0, [Case("x=1", lambda fn: fn(1), equal(1))])
    with pytest.raises(PuzzleNotSolvedError) as raised:
        grade("p", lambda x: 0, [Case("x=1", lambda fn: fn(1), equal(1))], strict=True)
    assert str(raised.value) == str(report) and isinstance(raised.value, AssertionError)
    assert isinstance(grade("p", lambda x: 1, [Case("x=1", lambda fn: fn(1), equal(1))], strict=True), Report)


def test_what_the_code_returned_is_judged_within_the_time_limit_and_never_crashes_the_check(time_limit):
    class Raises:
        def __eq__(self, other):
            raise TypeError("cannot compare")

    class Loops:
        def __eq__(self, other):
            while True:
                pass

    time_limit(0.2)
    for returned, why in ((Raises(), "raised TypeError: cannot compare"),
                          (Loops(), "ran past the time limit of 0.2 s")):
        report = grade("p", lambda x: returned, [Case("x=1", lambda fn: fn(1), equal(1))])
        assert str(report).startswith("p: not yet: case 1 (x=1): your code returned ")
        assert f"which kvlab could not compare with the answer: the comparison {why}" in str(report)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="SIGALRM: POSIX only")
def test_a_loop_fails_its_case_and_the_previous_alarm_handler_and_timer_come_back(time_limit):
    def loops(x):
        while True:
            pass

    def theirs(signum, frame):
        raise AssertionError("the previous timer was not meant to fire during the test")

    time_limit(0.2)
    previous = signal.signal(signal.SIGALRM, theirs)
    signal.setitimer(signal.ITIMER_REAL, 600)
    try:
        report = grade("p", loops, [Case("x=1", lambda fn: fn(1), equal(1))])
        assert str(report) == ("p: not yet: case 1 (x=1): your code ran past the time limit of 0.2 s "
                               "(kvlab.puzzles.grading.TIME_LIMIT_S): does it loop forever?")
        assert signal.getsignal(signal.SIGALRM) is theirs and 0 < signal.getitimer(signal.ITIMER_REAL)[0] < 600
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_a_loop_fails_its_case_too_and_is_stopped(time_limit):
    time_limit(0.2)
    reports = []
    checking = threading.Thread(target=lambda: reports.append(puzzle("slot_mapping").module.check(
        WRONG_BY_NAME["slots_forever"])))
    checking.start()
    checking.join()
    assert "case 1 (" in str(reports[0]) and "your code ran past the time limit of 0.2 s" in str(reports[0])
    for worker in [thread for thread in threading.enumerate() if thread.name == WORKER_NAME]:
        worker.join(30)  # the loop was stopped (an exception raised into it), not left to burn a core
        assert not worker.is_alive()


def test_a_real_interrupt_stops_the_check_even_when_the_code_catches_it():
    def catches_everything(x):
        try:
            signal.raise_signal(signal.SIGINT)  # the user presses Ctrl-C while the code runs
        except KeyboardInterrupt:
            pass
        return 0

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        grade("p", catches_everything, [Case("x=1", lambda fn: fn(1), equal(1))])
    assert signal.getsignal(signal.SIGINT) is handler


# ---- the notebook's stubs -----------------------------------------------------------------------------------
def notebook_stubs() -> dict:
    """The stubs notebook 16 asks the learner to edit, defined as its cells define them."""
    jupytext = pytest.importorskip("jupytext")
    code = [cell.source for cell in jupytext.read(NOTEBOOKS / "16_puzzles.py").cells if cell.cell_type == "code"]
    namespace = {}
    exec(next(source for source in code if "def grade(" in source), namespace)  # the notebook's imports
    stubs = {p.stub for p in PUZZLES}
    for i, source in enumerate(code):
        defined = re.match(r"(?:@[\w.]+\n)?(def|class) (\w+)", source)
        if defined and defined[2] in stubs:
            filename = f"<notebook 16, code cell {i}>"  # where inspect (and Triton) find a kernel's source
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            exec(compile(source, filename, "exec"), namespace)
    return {p.name: namespace.get(p.stub) for p in PUZZLES}


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_notebooks_stubs_match_the_puzzles_and_say_not_yet():
    for name, stub in notebook_stubs().items():
        p = puzzle(name)
        assert stub is not None, f"notebook 16 has no cell defining {p.stub}"
        ours = getattr(p.module, p.stub)
        if inspect.isclass(ours):  # the same base class, and the same methods to write
            assert stub.__mro__[1] is ours.__mro__[1], name
            methods = [m for m, f in vars(ours).items() if inspect.isfunction(f)]
            assert [parameters(getattr(stub, m)) for m in methods] == [parameters(getattr(ours, m)) for m in methods]
        else:
            assert parameters(stub) == parameters(ours), name
        assert str(p.module.check(stub)) == f"{name}: not yet: {NOT_YET}"


@pytest.mark.parametrize("p", PUZZLES, ids=lambda p: p.name)
def test_a_check_refuses_bad_arguments_saying_what_it_takes(p):
    with pytest.raises(InvalidArgumentError, match="check takes your function"):
        p.module.check(p.stub)  # the name, not the function
    for bad in ({"num_cases": 0}, {"seed": "0"}):
        with pytest.raises(InvalidArgumentError, match=list(bad)[0]):
            p.module.check(p.solution(), **bad)
