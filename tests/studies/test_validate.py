"""``kvlab validate``: every fast row stays within its tolerance (CI runs them), the command's output and errors."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlab.cli import main as kvlab_main
from kvlab.studies import validate
from kvlab.studies.validate import CHECKS, Row, main, markdown

REPO = Path(__file__).parents[2]


def test_every_fast_row_is_within_its_tolerance_and_imports_no_torch():
    # The whole default run, as a user runs it: `kvlab validate --json`, in a fresh interpreter.
    code = ("import sys; from kvlab.cli import main; rc = main(['validate', '--json']); "
            "print('torch loaded:', 'torch' in sys.modules); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    *table, torch_line = run.stdout.strip().splitlines()
    rows = json.loads("\n".join(table))
    out = [f"{r['check']}: kvlab {r['measured']} vs {r['published']} (tolerance {r['tolerance']})"
           for r in rows if r["status"] == "OUT"]
    assert run.returncode == 0 and not out, (out, run.stderr)
    assert torch_line == "torch loaded: False"
    checked = {r["check"] for r in rows if r["status"] == "ok"}
    assert {"dynamo_cache_efficiency", "mooncake_conversation_cache_ratio", "mooncake_synthetic_cache_ratio",
            "paged_attention_token_states", "vllm_hybrid_528_block", "vllm_hybrid_8320_block",
            "vllm_eagle_last_block_drop", "agentic_consecutive_median", "agentic_consecutive_mean"} <= checked
    assert all(r["source"] and r["note"] for r in rows)
    assert not {r["check"] for r in rows} & {"sharing_beam_4", "agentic_cpu_tier_95"}  # slow rows: --full only
    # docs/validate.md shows a run of today's code: regenerate it (kvlab validate --full --markdown) when a row moves.
    page = (REPO / "docs" / "validate.md").read_text(encoding="utf-8").splitlines()
    fields = set(Row.__dataclass_fields__)
    stale = [line for line in markdown([Row(**{k: v for k, v in r.items() if k in fields}) for r in rows])
             .splitlines()[2:] if line not in page]
    assert not stale, stale


def test_the_vllm_laws_are_reproduced_exactly():
    eagle, = validate.check_eagle()
    assert eagle.measured == eagle.published == (0, 4288, 8576, 12864, 15008) and eagle.status == "ok"
    hybrid, = validate.check_hybrid_block()
    assert hybrid.measured == (0.0, 0.0, round(100 * 528 / 552, 2), round(100 * 528 / 979, 2))


def test_the_sharing_study_gives_notebook_03b_s_numbers():
    # The same draws as the notebook's section 3 (its rendered table: Alpaca, 2 beams saved 41.1%).
    assert round(validate._sharing_saving("beam search", 2), 1) == 41.1


@pytest.mark.parametrize("row, gap, status", [
    (Row("a", "f", "s", 10.0, 12.0, "%", 2.0, "n"), 2.0, "ok"),
    (Row("a", "f", "s", 10.0, 7.5, "%", 2.0, "n"), -2.5, "OUT"),
    (Row("a", "f", "s", (0, 5, 9), (0, 4, 10), "tokens", 0.0, "n"), -1.0, "OUT"),
    (Row("a", "f", "s", 10.0, 30.0, "%", None, "n"), 20.0, "reported"),
    (Row("a", "f", "s", None, 30.0, "blocks", None, "n"), None, "kvlab only"),
    (Row("a", "f", "s", 10.0, None, "%", None, "n"), None, "not reproduced"),
])
def test_a_rows_gap_is_its_largest_and_its_status_says_whether_it_was_checked(row, gap, status):
    assert row.gap == gap and row.status == status


def fake_checks(monkeypatch, *rows):
    monkeypatch.setattr(validate, "CHECKS", [("fake", False, lambda: list(rows))])


def test_a_row_outside_its_tolerance_fails_the_command_and_is_named(monkeypatch, capsys):
    fake_checks(monkeypatch, Row("fine", "f", "s", 1.0, 1.0, "%", 0.5, "n"),
                Row("drifted", "f", "s", 10.0, 12.0, "%", 1.0, "n"))
    assert main([]) == 1
    captured = capsys.readouterr()
    assert "drifted" in captured.out and "OUT" in captured.out
    assert captured.err.strip() == "kvlab validate: 1 figure(s) outside their tolerance: drifted"


def test_csv_json_and_markdown_carry_every_row(monkeypatch, capsys):
    fake_checks(monkeypatch, Row("law", "a | law", "issue #1", (0, 2), (0, 2), "tokens", 0.0, "why"),
                Row("gone", "g", "issue #2", 5.0, None, "%", None, "no workload"))
    assert main(["--csv"]) == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(frame["check"]) == ["law", "gone"] and list(frame["status"]) == ["ok", "not reproduced"]
    assert main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["measured"] == [0, 2] and rows[1]["measured"] is None and rows[1]["gap"] is None
    assert main(["--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "a \\| law" in lines[2]
    assert "| 0, 2 tokens | 0, 2 tokens | 0 tokens | ±0 tokens | ok |" in lines[2]
    assert "| 5% | - | - | - | not reproduced | no workload |" in lines[3]


def test_one_check_runs_alone_through_the_kvlab_command(capsys):
    assert kvlab_main(["validate", "--check", "eagle", "--csv"]) == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(frame["check"]) == ["vllm_eagle_last_block_drop"] and frame["status"][0] == "ok"


def exit_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--check", "nope"], "argument --check: invalid choice: 'nope' (choose from "),
    (["--csv", "--json"], "argument --json: not allowed with argument --csv"),
    (["--fast"], "unrecognized arguments: --fast"),
    (["--full=yes"], "argument --full: ignored explicit argument 'yes'"),
])
def test_bad_options_are_one_clear_error(argv, message, capsys):
    error = exit_error(argv, capsys)
    assert error.startswith("kvlab validate: error: ") and message in error, error
    if argv[0] == "--check":
        assert all(name in error for name, _, _ in CHECKS)


def test_an_empty_or_unknown_check_list_is_refused():
    with pytest.raises(ValueError, match="unknown check 'nope'; known: mooncake, "):
        validate.validate(checks=["nope"])
    with pytest.raises(ValueError, match="no check named; known: mooncake, "):
        validate.validate(checks=[])
