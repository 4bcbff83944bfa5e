"""answer(): never raises on a learner's value, says which of unanswered / right / wrong, and why."""

import pytest

from kvlab.course import answer
from kvlab.errors import InvalidArgumentError


def test_unanswered_prints_how_to_answer_and_returns_none(capsys):
    assert answer(None, 3, "three blocks") is None
    assert "Not answered yet" in capsys.readouterr().out


def test_right_answer_says_right_and_why(capsys):
    assert answer(3, 3, "two full blocks and a partial one") is True
    out = capsys.readouterr().out
    assert out.startswith("Right: 3.") and "partial one" in out


def test_wrong_answer_says_what_was_said_what_is_true_and_why(capsys):
    assert answer(2, 3, "the last block is partial") is False
    out = capsys.readouterr().out
    assert "you said 2" in out and "gives 3" in out and "partial" in out


def test_a_bool_is_not_a_count():
    assert answer(True, 1, "one copy") is False
    assert answer(True, True, "it overflows") is True


def test_numbers_within_the_tolerance_and_strings_ignoring_case():
    assert answer(0.31, 0.3, "about a third", rel_tol=0.05) is True
    assert answer(0.4, 0.3, "about a third", rel_tol=0.05) is False
    assert answer(" LRU", "lru", "recency") is True
    assert answer([1, 2], [1, 2], "a list compares by value") is True


@pytest.mark.parametrize("kwargs", [dict(why=""), dict(why="x", rel_tol=-1)])
def test_bad_arguments_from_the_notebook_raise(kwargs):
    with pytest.raises(InvalidArgumentError):
        answer(1, 1, **kwargs)
