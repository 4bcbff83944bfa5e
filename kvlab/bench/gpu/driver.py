"""``python -m kvlab.bench gpu --out DIR [--dry-run] [--stages env,tests,...] [--time-box STAGE=SECONDS]
[--model DIR]``: run the run book's stages in order, each in its own process under its time box, and write
the log and the summary into DIR. A stage that fails, crashes or runs out of time is recorded and the next
one starts. Exit status 0 only when every stage ran clean."""

import argparse
import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kvlab
from kvlab.bench.gpu.report import LOG, SUMMARY, SUMMARY_COLUMNS, read_report
from kvlab.bench.gpu.stage import STAGES

#: Seconds per stage. On an H100 the whole book fits 20 minutes, and it splits into two device commands of
#: under 10 each (env,tests,kernels | engine,plots): see the README's benchmark section.
TIME_BOXES = {"env": 60, "tests": 240, "kernels": 240, "engine": 480, "plots": 60}
#: The dry run's boxes: generous for a shared 2-core CI machine, where it takes a couple of minutes.
DRY_RUN_TIME_BOXES = {"env": 60, "tests": 180, "kernels": 180, "engine": 240, "plots": 60}


def parse_time_boxes(values, defaults):
    boxes = dict(defaults)
    for value in values:
        name, _, seconds = value.partition("=")
        if name not in boxes or not seconds.replace(".", "", 1).isdigit() or float(seconds) <= 0:
            raise argparse.ArgumentTypeError(f"--time-box takes STAGE=SECONDS with STAGE one of {STAGES}, "
                                             f"got {value!r}")
        boxes[name] = float(seconds)
    return boxes


def stage_env():
    """The stages import this checkout's kvlab, whatever is installed; output unbuffered, so that a killed
    stage's last words are in the log."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(kvlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_stage(name, args, seconds, report, log):
    """Run one stage under its box; returns (status, detail)."""
    command = [sys.executable, "-m", "kvlab.bench.gpu.stage", name, "--out", str(args.out), "--report", str(report),
               "--seconds", str(seconds)] + (["--dry-run"] if args.dry_run else []) \
        + (["--model", args.model] if args.model else [])
    # A session of its own: at the box, the stage goes down with everything it started (pytest workers,
    # compute-sanitizer), and nothing else.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=stage_env(), start_new_session=True)
    try:
        returncode = process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "timed out", f"killed at its {seconds:g} s box"
    if returncode == 0:
        return "ok", ""
    return "failed", f"exit status {returncode}"


def write_summary(rows, path):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the CSVs, PNGs and log (flat)")
    parser.add_argument("--dry-run", action="store_true", help="the same code on CPU at tiny sizes (CI)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    parser.add_argument("--time-box", action="append", default=[], metavar="STAGE=SECONDS",
                        help=f"override a stage's box (defaults: {TIME_BOXES}; dry run: {DRY_RUN_TIME_BOXES})")
    parser.add_argument("--model", help="a local Llama/Qwen3 directory for the engine stage (default: random "
                                        "weights of Qwen3-0.6B's shape, or a tiny model in a dry run)")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if not stages or set(stages) - set(STAGES):
        parser.error(f"--stages takes names from {STAGES}, got {args.stages!r}")
    try:
        boxes = parse_time_boxes(args.time_box, DRY_RUN_TIME_BOXES if args.dry_run else TIME_BOXES)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    rows, summary = [], args.out / SUMMARY
    with (args.out / LOG).open("a") as log, tempfile.TemporaryDirectory() as reports:
        for name in stages:
            banner = f"==== stage {name} ({'dry run, ' if args.dry_run else ''}box {boxes[name]:g} s) " \
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
            print(banner, flush=True)
            log.write(banner + "\n")
            log.flush()
            report, start = Path(reports) / f"{name}.jsonl", time.monotonic()
            status, detail = run_stage(name, args, boxes[name], report, log)
            checks = read_report(report)
            rows.append(dict(stage=name, check="(stage)", status=status, seconds=round(time.monotonic() - start, 1),
                             detail=detail or f"{sum(c['status'] == 'ok' for c in checks)} of {len(checks)} checks ok"))
            rows.extend(checks)
            write_summary(rows, summary)  # after every stage: a run cut off later keeps what was done
            log.write(f"==== stage {name}: {status} {detail}\n")
            log.flush()
            for row in [rows[-len(checks) - 1]] + checks:
                print(f"  {row['check']:<34} {row['status']:<9} {row['seconds']:>7} s  {row['detail'][:110]}")
    print(f"wrote {summary} and {args.out / LOG}")
    return 0 if all(r["status"] == "ok" for r in rows if r["check"] == "(stage)") else 1
