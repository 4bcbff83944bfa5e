"""The puzzles grade themselves (kvlab.puzzles): every solution passes its check, every untouched stub fails it
saying "not yet", and plausible wrong solutions fail with a report that names the mistake."""

import inspect
import re
from pathlib import Path

import pytest

from kvlab.errors import InvalidArgumentError, KvlabError, PuzzleNotSolvedError
from kvlab.puzzles import PUZZLES, Report, puzzle
from kvlab.puzzles.grading import NOT_YET, Case, equal, grade
from wrong_solutions import WRONG

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
BY_NAME = {p.name: p for p in PUZZLES}


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


@pytest.mark.parametrize("name, wrong, words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_a_plausible_wrong_solution_fails_with_a_report_naming_the_mistake(name, wrong, words):
    report = puzzle(name).module.check(wrong)
    assert not report.passed
    assert re.match(rf"{name}: not yet: case \d+ \(.+\): ", str(report)), str(report)  # the case and its inputs
    assert words in str(report), str(report)


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


# ---- the notebook's stubs -----------------------------------------------------------------------------------
def notebook_stubs() -> dict:
    """The stubs notebook 16 asks the learner to edit, defined as its cells define them."""
    jupytext = pytest.importorskip("jupytext")
    code = [cell.source for cell in jupytext.read(NOTEBOOKS / "16_puzzles.py").cells if cell.cell_type == "code"]
    namespace = {}
    exec(next(source for source in code if "def grade(" in source), namespace)  # the notebook's imports
    stubs = {p.stub for p in PUZZLES}
    for source in code:
        if re.match(r"(def|class) (\w+)", source) and re.match(r"(def|class) (\w+)", source)[2] in stubs:
            exec(source, namespace)
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
