"""The homework edition: ``kvlab course export`` makes a student's or an instructor's copy of the notebooks
from the same jupytext sources, and ``kvlab course grade`` runs a class's notebooks and writes a report a
classroom autograder reads (JUnit XML, JSON).

The student edition drops every answer: each markdown cell that starts with ``**Answer.**``, and every cell
tagged ``instructor`` in its source (``# %% tags=["instructor"]``: notebook 16's peek at the solutions and its
check of kvlab's own). It calls ``kvlab.course.student_edition()`` right after the setup cell, so that a wrong
prediction gets a hint and ``kvlab.course.reveal()`` shows the truth on request. The solutions are not in it,
and not in an installed kvlab either: ``kvlab.puzzles.solutions`` ships only with a checkout (pyproject.toml
leaves it out of the wheel). The instructor edition is the notebooks as they are.

The notebooks read committed data beside them (``../data``, ``../tests/sizing``), so an edition is written to
a folder directly inside the kvlab checkout (``kvlab course export --student homework``).

Grading runs each notebook of a folder top to bottom in a fresh kernel (as the notebook tests do, headless:
``KVLAB_CI=1``) with ``$KVLAB_GRADES`` naming a file where every ``answer`` and every puzzle ``check`` records
its verdict (``kvlab.puzzles.grading.record_grade``). One test case per exercise and per puzzle check, named
after the notebook; an unanswered exercise fails; a notebook that stops on an error is one error case (its
later exercises never ran).
"""

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from kvlab.errors import InvalidArgumentError
from kvlab.puzzles.grading import GRADES_ENV

CHECKOUT = Path(__file__).resolve().parents[2]
NOTEBOOKS = CHECKOUT / "notebooks"
INSTRUCTOR_TAG = "instructor"
ANSWER_LEAD = "**Answer.**"
STUDENT_CELL = ("import kvlab.course\n\n"
                "kvlab.course.student_edition()  # a wrong prediction gets a hint; kvlab.course.reveal() shows the "
                "answer")


def export(edition: str, out_dir, notebooks_dir=NOTEBOOKS) -> list[Path]:
    """Write ``edition`` ("student" or "instructor") of every notebook in ``notebooks_dir`` (jupytext ``.py``
    sources) to ``out_dir`` as ``.ipynb`` files without outputs; returns them. ``out_dir`` must be a folder
    directly inside the checkout (created if missing), and must not be the notebooks' own folder."""
    import jupytext

    if edition not in ("student", "instructor"):
        raise InvalidArgumentError(f"edition must be 'student' or 'instructor', got {edition!r}")
    sources = sorted(Path(notebooks_dir).glob("*.py"))
    if not sources:
        raise InvalidArgumentError(f"no notebook sources (*.py) in {notebooks_dir}: export runs from a kvlab "
                                   "checkout, whose notebooks/ holds them")
    out = Path(out_dir).resolve()
    root = Path(notebooks_dir).resolve().parent
    if out.parent != root or out == Path(notebooks_dir).resolve():
        raise InvalidArgumentError(f"write the edition to a new folder directly inside the checkout {root} (the "
                                   f"notebooks read ../data and ../tests from there), got {out}")
    out.mkdir(exist_ok=True)
    written = []
    for source in sources:
        notebook = jupytext.read(source)
        if edition == "student":
            notebook.cells = _student_cells(notebook.cells)
        target = out / source.with_suffix(".ipynb").name
        jupytext.write(notebook, target)
        written.append(target)
    return written


def _student_cells(cells) -> list:
    kept = [cell for cell in cells
            if INSTRUCTOR_TAG not in cell.metadata.get("tags", ())
            and not (cell.cell_type == "markdown" and cell.source.lstrip().startswith(ANSWER_LEAD))]
    first_code = next(i for i, cell in enumerate(kept) if cell.cell_type == "code")  # the setup cell
    from nbformat.v4 import new_code_cell

    return kept[:first_code + 1] + [new_code_cell(STUDENT_CELL)] + kept[first_code + 1:]


@dataclass
class NotebookGrades:
    notebook: str
    grades: list = field(default_factory=list)  # the recorded verdicts: kind, name, passed, message
    error: str | None = None                    # why the run stopped, if it did


def grade(folder, *, timeout_s: float = 1800) -> list[NotebookGrades]:
    """Run every ``.ipynb`` of ``folder`` (sorted) in a fresh kernel of this Python, in that folder, and collect
    the verdicts."""
    import nbclient
    import nbformat

    notebooks = sorted(Path(folder).glob("*.ipynb"))
    if not notebooks:
        raise InvalidArgumentError(f"no notebooks (*.ipynb) to grade in {folder}")
    results = []
    for path in notebooks:
        with tempfile.TemporaryDirectory() as scratch:
            record = Path(scratch) / "grades.jsonl"
            spec = Path(scratch) / "kernels" / "python3"  # a "python3" kernel running this interpreter
            spec.mkdir(parents=True)
            (spec / "kernel.json").write_text(json.dumps(
                {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                 "display_name": "Python 3 (kvlab course grade)", "language": "python"}))
            environment = {GRADES_ENV: str(record), "KVLAB_CI": "1", "MPLBACKEND": "Agg",
                           "JUPYTER_PATH": os.pathsep.join(filter(None, [scratch, os.environ.get("JUPYTER_PATH")]))}
            saved = {name: os.environ.get(name) for name in environment}
            os.environ.update(environment)  # the kernel inherits this process's environment
            result = NotebookGrades(path.stem)
            try:
                nbclient.NotebookClient(nbformat.read(path, as_version=4), timeout=timeout_s, kernel_name="python3",
                                        startup_timeout=180,
                                        resources={"metadata": {"path": str(path.parent)}}).execute()
            except Exception as error:  # noqa: BLE001 - a learner's notebook may stop anywhere: one error case
                lines = _plain(str(error)).strip().splitlines()
                result.error = f"{type(error).__name__}: {lines[-1] if lines else ''}"
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            if record.is_file():
                result.grades = [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()]
            results.append(result)
    return results


def junit_xml(results: list[NotebookGrades]) -> str:
    """The report as JUnit XML: a test suite per notebook, a test case per verdict (a failure when not passed),
    and an error case for a notebook that stopped."""
    suites = ElementTree.Element("testsuites", name="kvlab course")
    for result in results:
        failures = sum(not g["passed"] for g in result.grades)
        suite = ElementTree.SubElement(suites, "testsuite", name=result.notebook,
                                       tests=str(len(result.grades) + bool(result.error)), failures=str(failures),
                                       errors=str(int(bool(result.error))))
        for g in result.grades:
            case = ElementTree.SubElement(suite, "testcase", classname=f"{result.notebook}.{g['kind']}",
                                          name=g["name"])
            if not g["passed"]:
                ElementTree.SubElement(case, "failure", message=_plain(g["message"]))
        if result.error:
            case = ElementTree.SubElement(suite, "testcase", classname=f"{result.notebook}.run", name="runs to the end")
            ElementTree.SubElement(case, "error", message=result.error)
    return ElementTree.tostring(suites, encoding="unicode")


def _plain(text: str) -> str:
    """``text`` without terminal colours (a traceback's) and without characters XML 1.0 cannot hold."""
    return re.sub("[^\t\n\r\x20-\ud7ff\ue000-\ufffd]", "", re.sub(r"\x1b\[[0-9;]*m", "", text))


def summary_json(results: list[NotebookGrades]) -> dict:
    passed = sum(g["passed"] for r in results for g in r.grades)
    total = sum(len(r.grades) for r in results)
    return {"passed": passed, "total": total,
            "notebooks": [{"notebook": r.notebook, "error": r.error, "grades": r.grades} for r in results]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvlab course", description="The homework edition of kvlab's course.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    make = commands.add_parser("export", help="write the student's or the instructor's edition of the notebooks")
    which = make.add_mutually_exclusive_group(required=True)
    which.add_argument("--student", metavar="DIR", help="the student edition (no answers, hints first) into DIR")
    which.add_argument("--instructor", metavar="DIR", help="the instructor edition (the notebooks as they are)")
    check = commands.add_parser("grade", help="run a folder of notebooks and report every exercise and puzzle")
    check.add_argument("folder", help="the learner's folder of .ipynb notebooks")
    check.add_argument("--junit", metavar="FILE", help="write a JUnit XML report here (classroom autograders)")
    check.add_argument("--json", metavar="FILE", help="write a JSON report here")
    check.add_argument("--timeout", type=float, default=1800, help="seconds per notebook cell (default: 1800)")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            edition, out = ("student", args.student) if args.student else ("instructor", args.instructor)
            written = export(edition, Path(args.student or args.instructor))
            print(f"kvlab course: the {edition} edition of {len(written)} notebooks is in {out}")
            return 0
        results = grade(args.folder, timeout_s=args.timeout)
    except InvalidArgumentError as error:
        parser.error(str(error))
    if args.junit:
        Path(args.junit).write_text(junit_xml(results), encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(summary_json(results), indent=1), encoding="utf-8")
    report = summary_json(results)
    for r in results:
        right = sum(g["passed"] for g in r.grades)
        print(f"{r.notebook}: {right} of {len(r.grades)} right" + (f"; stopped: {r.error}" if r.error else ""))
    print(f"kvlab course: {report['passed']} of {report['total']} right")
    return 0 if report["passed"] == report["total"] and not any(r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
