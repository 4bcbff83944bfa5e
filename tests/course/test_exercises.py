"""answer(): never raises on a learner's value, says which of unanswered / right / wrong, and why."""

import sys

import numpy as np
import pandas as pd
import pytest

from kvlab.course import answer
from kvlab.errors import InvalidArgumentError
from kvlab.puzzles import grading


def test_unanswered_prints_how_to_answer_and_returns_none(capsys):
    assert answer(None, 3, "three blocks").right is None
    assert "Not answered yet" in capsys.readouterr().out


def test_right_answer_says_right_and_why(capsys):
    assert answer(3, 3, "two full blocks and a partial one").right is True
    out = capsys.readouterr().out
    assert out.startswith("Right: 3.") and "partial one" in out


def test_wrong_answer_says_what_was_said_what_is_true_and_why(capsys):
    assert answer(2, 3, "the last block is partial").right is False
    out = capsys.readouterr().out
    assert "you said 2" in out and "gives 3" in out and "partial" in out


def test_a_bool_is_not_a_count():
    assert answer(True, 1, "one copy").right is False
    assert answer(True, True, "it overflows").right is True


def test_numbers_within_the_tolerance_and_strings_ignoring_case():
    assert answer(0.31, 0.3, "about a third", rel_tol=0.05).right is True
    assert answer(0.4, 0.3, "about a third", rel_tol=0.05).right is False
    assert answer(" LRU", "lru", "recency").right is True
    assert answer([1, 2], [1, 2], "a list compares by value").right is True


def test_numpy_values_are_the_python_values_they_hold(capsys):
    assert answer(np.True_, True, "numpy computed it").right is True
    assert answer(True, np.True_, "numpy computed it").right is True
    assert capsys.readouterr().out.startswith("Right: True. ")
    assert answer(np.int64(3), 3, "a count").right is True and answer(3, np.int64(3), "a count").right is True
    assert answer(np.float32(0.31), 0.3, "about a third", rel_tol=0.05).right is True
    assert answer(np.True_, 1, "one copy").right is False  # still a bool, not a count


def test_arrays_and_series_compare_element_wise_with_their_shape(capsys):
    assert answer(np.array([1, 2]), [1, 2], "two counts").right is True
    assert answer([1, 2], pd.Series([1, 2], index=["a", "b"]), "a Series by its values, in order").right is True
    assert answer(np.array([[1.0, 2.01]]), np.array([[1, 2]]), "within 1%", rel_tol=0.01).right is True
    assert answer((1, 2), [1, 2], "a tuple is a sequence too").right is True
    capsys.readouterr()
    for yours, truth, says in (([1, 2, 3], np.array([1, 2]), "(you gave 3 values, the run gives 2)"),
                               (np.array([3]), 3, "(the run gives one value; you gave 1)"),
                               (3, pd.Series([1, 2, 3]), "(the run gives 3 values, not one: answer with a list"),
                               ([[1, 2]], [1, 2], "(your answer has shape (1, 2), the run's has shape (2,))"),
                               ([1, True], np.array([1, 1]), "")):
        assert answer(yours, truth, "why").right is False
        assert says in capsys.readouterr().out


def test_ints_compare_exactly_whatever_their_size():
    assert answer(10**400, 1.0, "a float is at most 1.8e308").right is False
    assert answer(10**400, 10**400, "exact").right is True
    assert answer(10**400, float("inf"), "inf is no number of blocks", rel_tol=0.5).right is False
    assert answer(10**20 + 1, 10**20, "a float would round both to 1e20").right is False
    assert answer(10**20 + 1, 10**20, "within the tolerance", rel_tol=1e-9).right is True


def test_a_value_whose_comparison_fails_loops_or_exits_is_a_wrong_answer_that_says_so(monkeypatch, capsys):
    class Raises:
        def __eq__(self, other):
            raise TypeError("cannot compare")

    class Loops:
        def __eq__(self, other):
            while True:
                pass

    class Exits:
        def __eq__(self, other):
            sys.exit(0)

    monkeypatch.setattr(grading, "TIME_LIMIT_S", 0.2)
    for yours, says in ((Raises(), "(the comparison raised TypeError: cannot compare)"),
                        (Loops(), "(the comparison ran past the time limit of 0.2 s"),
                        (Exits(), "(the comparison raised SystemExit(0)")):
        assert answer(yours, 3, "three").right is False
        out = capsys.readouterr().out
        assert out.startswith("Not quite: you said <") and says in out, out


@pytest.mark.parametrize("kwargs", [dict(why=""), dict(why="x", rel_tol=-1)])
def test_bad_arguments_from_the_notebook_raise(kwargs):
    with pytest.raises(InvalidArgumentError):
        answer(1, 1, **kwargs)


@pytest.mark.parametrize("rel_tol", [None, "0.1", [0.1], True, float("inf")])
def test_a_tolerance_that_is_no_finite_number_raises_saying_what_is_allowed(rel_tol):
    with pytest.raises(InvalidArgumentError, match=r"rel_tol .*must be a finite number >= 0"):
        answer(1, 1, "x", rel_tol=rel_tol)


def test_unanswered_names_the_variable_to_set_and_a_verdict_shows_nothing_more(capsys):
    PREDICTED_BLOCKS = None
    verdict = answer(PREDICTED_BLOCKS, 3, "three blocks")
    assert "set PREDICTED_BLOCKS (now None)" in capsys.readouterr().out
    assert verdict.right is None and not verdict
    verdict._ipython_display_()  # what IPython shows for a cell ending with answer(...): nothing
    assert capsys.readouterr().out == ""


def test_the_explanation_starts_with_a_capital_after_the_verdict(capsys):
    assert answer(2, 2, "two blocks: one full, one partial").right is True
    assert capsys.readouterr().out.startswith("Right: 2. Two blocks: one full")


@pytest.fixture
def student(monkeypatch):
    from kvlab.course import exercises

    monkeypatch.setattr(exercises, "_student", False)
    monkeypatch.setattr(exercises, "_withheld", {})
    exercises.student_edition()
    return exercises


def test_the_student_edition_hints_first_and_reveals_on_request(student, capsys):
    PREDICTED_BLOCKS = 2
    assert answer(PREDICTED_BLOCKS, 3, "two full blocks and a partial one").right is False
    out = capsys.readouterr().out
    assert "higher" in out and "3" not in out.replace("you said 2", "") and "partial one" not in out
    assert "reveal('PREDICTED_BLOCKS')" in out
    student.reveal("PREDICTED_BLOCKS")
    assert capsys.readouterr().out == "PREDICTED_BLOCKS: the run gives 3. Two full blocks and a partial one\n"
    PREDICTED_POLICY = "fifo"
    answer(PREDICTED_POLICY, "lru", "recency")
    assert "(not that one)" in capsys.readouterr().out
    PREDICTED_BLOCKS = 3
    answer(PREDICTED_BLOCKS, 3, "two full blocks and a partial one")
    assert capsys.readouterr().out.startswith("Right: 3.")  # a right answer says everything, as before


def test_every_verdict_is_recorded_for_a_class_report_when_asked(tmp_path, monkeypatch, capsys):
    import json

    grades = tmp_path / "grades.jsonl"
    monkeypatch.setenv("KVLAB_GRADES", str(grades))
    PREDICTED_A, PREDICTED_B = None, 4
    answer(PREDICTED_A, 3, "three")
    answer(PREDICTED_B, 4, "four")
    from kvlab.puzzles import puzzle
    puzzle("slot_mapping").module.check(lambda *args: [])
    rows = [json.loads(line) for line in grades.read_text().splitlines()]
    assert [(r["kind"], r["name"], r["passed"]) for r in rows] == [
        ("exercise", "PREDICTED_A", False), ("exercise", "PREDICTED_B", True), ("puzzle", "slot_mapping", False)]
    assert rows[0]["message"] == "not answered"
