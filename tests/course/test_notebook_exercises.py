"""Every exercise in a notebook graded by ``kvlab.course.answer`` has its three parts: the question, a cell the
learner edits that is checked by ``answer`` (committed unanswered, so the notebook runs top to bottom in CI),
and the answer, clearly marked. Fast and static: the notebook runs themselves are tests/test_notebooks.py's."""

import re
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.py"))
WITH_EXERCISES = [py for py in NOTEBOOKS if "from kvlab.course import answer" in py.read_text(encoding="utf-8")]


def exercises(py: Path):
    """(question cell index, cells) for every markdown cell that poses an exercise."""
    cells = jupytext.read(py).cells
    return [(i, cells) for i, cell in enumerate(cells)
            if cell.cell_type == "markdown" and ("**Exercise.**" in cell.source or "Exercise:" in cell.source)]


def posed_exercises(py: Path) -> list[int]:
    """Index of every markdown cell that looks like an exercise to a reader: a heading or a bold lead that
    names one, however it is numbered."""
    return [i for i, cell in enumerate(jupytext.read(py).cells)
            if cell.cell_type == "markdown" and re.search(r"^#+ .*\bExercise\b|\*\*Exercise\b", cell.source, re.M)]


def test_the_course_has_exercises():
    assert len(WITH_EXERCISES) >= 10


@pytest.mark.parametrize("py", WITH_EXERCISES, ids=lambda path: path.stem)
def test_every_exercise_has_a_checked_cell_committed_unanswered_then_its_answer(py: Path):
    found = exercises(py)
    assert found, f"{py.name} imports answer() but poses no exercise as '**Exercise.**' or '## ... Exercise: ...'"
    for i, cells in found:
        checked, answer = cells[i + 1], cells[i + 2]
        assert checked.cell_type == "code" and "answer(" in checked.source, (
            f"{py.name}, cell {i + 1}: an exercise's next cell must check the learner's value with answer()")
        predictions = [line for line in checked.source.splitlines() if line.startswith("PREDICTED_")]
        assert predictions and all(" = None" in line for line in predictions), (
            f"{py.name}, cell {i + 1}: every PREDICTED_ value must be committed as None (unanswered)")
        assert answer.cell_type == "markdown" and answer.source.startswith("**Answer.**"), (
            f"{py.name}, cell {i + 2}: the cell after an exercise's check must start with '**Answer.**'")


@pytest.mark.parametrize("py", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_exercise_a_reader_sees_is_one_the_layout_check_sees(py: Path):
    """An exercise graded inline (no answer()) or titled so that exercises() misses it ("Exercise 1: ...")
    would escape the check above."""
    checked = {i for i, _ in exercises(py)} if py in WITH_EXERCISES else set()
    unchecked = [i for i in posed_exercises(py) if i not in checked]
    assert not unchecked, (f"{py.name}: cells {unchecked} pose exercises outside the course's layout: title them "
                           "'### Exercise: ...' (or lead with '**Exercise.**') and grade them with "
                           "kvlab.course.answer")
