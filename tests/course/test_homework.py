"""The homework edition (kvlab.course.homework): a student copy with no answers and no solutions, and a grader
that runs a class's notebooks and writes a report an autograder reads."""

import json
import sys
import tomllib
from pathlib import Path
from xml.etree import ElementTree

import jupytext
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from setuptools import find_packages

from kvlab.cli import main as kvlab_main
from kvlab.course import homework
from kvlab.errors import InvalidArgumentError, SolutionsNotShippedError
from kvlab.puzzles import puzzle

REPO = Path(__file__).resolve().parents[2]
GIVES_ANSWERS = ("**Answer.**", ".solution()", "solution_source(")


@pytest.fixture
def inside_checkout(tmp_path):
    """A fake checkout: its notebooks are copies of the real ones' sources; editions go beside them."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    for source in (REPO / "notebooks").glob("*.py"):
        (notebooks / source.name).write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return tmp_path


def test_the_student_edition_holds_no_answer_and_no_solution(inside_checkout):
    written = homework.export("student", inside_checkout / "homework", inside_checkout / "notebooks")
    assert len(written) == len(list((REPO / "notebooks").glob("*.py")))
    for path in written:
        cells = nbformat.read(path, as_version=4).cells
        leaks = [(i, phrase) for i, cell in enumerate(cells) for phrase in GIVES_ANSWERS if phrase in cell.source]
        assert not leaks, f"{path.name} gives answers away: {leaks}"
        setup = next(i for i, cell in enumerate(cells) if cell.cell_type == "code")
        assert cells[setup + 1].source == homework.STUDENT_CELL  # right after the setup cell: hints first
    instructor = homework.export("instructor", inside_checkout / "teacher", inside_checkout / "notebooks")
    source = "".join(cell.source for path in instructor for cell in nbformat.read(path, as_version=4).cells)
    assert all(phrase in source for phrase in GIVES_ANSWERS)  # the scan above would see them


def test_an_edition_goes_to_a_new_folder_directly_inside_the_checkout(inside_checkout, tmp_path_factory):
    with pytest.raises(InvalidArgumentError, match="directly inside the checkout"):
        homework.export("student", tmp_path_factory.mktemp("elsewhere") / "hw", inside_checkout / "notebooks")
    with pytest.raises(InvalidArgumentError, match="directly inside the checkout"):
        homework.export("student", inside_checkout / "notebooks", inside_checkout / "notebooks")
    with pytest.raises(InvalidArgumentError, match="'student' or 'instructor'"):
        homework.export("teacher", inside_checkout / "hw", inside_checkout / "notebooks")
    assert not (inside_checkout / "hw").exists()


def test_the_wheel_leaves_the_solutions_out():
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=found["include"], exclude=found.get("exclude", ()))
    assert "kvlab.puzzles" in packages and "kvlab.puzzles.solutions" not in packages


def test_without_the_solutions_asking_for_one_says_where_they_are(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvlab.puzzles.solutions.slot_mapping", None)  # as in an installed wheel
    with pytest.raises(SolutionsNotShippedError, match="ship with a kvlab checkout"):
        puzzle("slot_mapping").solution()


def _notebook(path: Path, *cells):
    nbformat.write(new_notebook(cells=list(cells), metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}}), path)


def test_grading_a_folder_writes_one_case_per_exercise_and_puzzle(tmp_path, capsys):
    folder = tmp_path / "alice"
    folder.mkdir()
    _notebook(folder / "a_exercises.ipynb",
              new_markdown_cell("# two exercises and a puzzle"),
              new_code_cell("from kvlab.course import answer\nPREDICTED_BLOCKS = 3\nPREDICTED_HITS = None\n"
                            "answer(PREDICTED_BLOCKS, 3, 'three')\nanswer(PREDICTED_HITS, 2, 'two')"),
              new_code_cell("from kvlab.puzzles import puzzle\n"
                            "puzzle('slot_mapping').module.check(lambda table, bs, start, end: [])"))
    _notebook(folder / "b_stops.ipynb", new_code_cell("from kvlab.course import answer\n"
                                                      "answer(1, 1, 'one')\nraise RuntimeError('my bug')"))
    junit, report = tmp_path / "report.xml", tmp_path / "report.json"
    status = kvlab_main(["course", "grade", str(folder), "--junit", str(junit), "--json", str(report)])
    assert status == 1 and "kvlab course: 2 of 4 right" in capsys.readouterr().out
    suites = ElementTree.parse(junit).getroot()
    cases = {(suite.get("name"), case.get("name")): [child.tag for child in case]
             for suite in suites for case in suite}
    assert cases == {("a_exercises", "PREDICTED_BLOCKS"): [], ("a_exercises", "PREDICTED_HITS"): ["failure"],
                     ("a_exercises", "slot_mapping"): ["failure"], ("b_stops", "1"): [],
                     ("b_stops", "runs to the end"): ["error"]}
    data = json.loads(report.read_text())
    assert (data["passed"], data["total"]) == (2, 4) and "my bug" in data["notebooks"][1]["error"]


def test_export_from_the_command_line(inside_checkout, monkeypatch, capsys):
    monkeypatch.setattr(homework, "NOTEBOOKS", inside_checkout / "notebooks")
    monkeypatch.setattr(homework.export, "__defaults__", (inside_checkout / "notebooks",))
    assert kvlab_main(["course", "export", "--student", str(inside_checkout / "hw")]) == 0
    assert "the student edition of" in capsys.readouterr().out
    assert jupytext.read(next((inside_checkout / "hw").glob("16_*.ipynb"))).cells


def test_a_student_edition_notebook_runs_and_grades_its_unanswered_exercises(inside_checkout):
    homework.export("student", inside_checkout / "homework", inside_checkout / "notebooks")
    for path in (inside_checkout / "homework").glob("*.ipynb"):
        if not path.name.startswith("01_"):
            path.unlink()  # one short notebook is enough here (the notebook tests run them all)
    [result] = homework.grade(inside_checkout / "homework")
    assert result.error is None and result.grades
    assert all(g["kind"] == "exercise" and g["message"] == "not answered" for g in result.grades)
    assert all(g["name"].startswith("PREDICTED_") for g in result.grades)
