"""What the driver and the stages share: the output files' names, and the record a stage keeps of its checks.

A stage appends one JSON line per check to a report file as soon as the check ends, so that the driver still
has every finished check when it has to kill the stage at its time box."""

import json
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: Every file the run book writes into its folder (the device machine returns at most 8, flat).
LOG = "runbook.log"
SUMMARY = "summary.csv"
SUMMARY_COLUMNS = ("stage", "check", "status", "seconds", "detail")
PLOTS = ("decode_bandwidth.png", "prefill.png", "engine.png")
ENGINE_PREFIX = "engine-"  # engine-<device slug>.csv; the kernel CSV is <device slug>.csv as in data/bench/


def device_slug(dry_run: bool) -> str:
    """The file-name stem for this machine's results: the GPU's name, or a dry run's fixed name."""
    from kvlab.bench.kernels import DRY_RUN_LABEL, gpu_slug

    if dry_run:
        return gpu_slug(DRY_RUN_LABEL)
    import torch

    return gpu_slug(torch.cuda.get_device_name())


@dataclass
class Stage:
    """Inside a stage's process: where to write, how long is left, and the checks' record."""
    name: str
    out: Path
    report: Path
    deadline: float       # time.monotonic() by which the stage should wrap up (its box, less a margin)
    dry_run: bool
    model: str | None = None
    failed: bool = False

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, check: str, status: str, detail: str = "", seconds: float = 0.0) -> None:
        """``status``: "ok", "failed", "skipped" or "timed out"; any but "failed" and "timed out" leaves the
        stage green."""
        self.failed |= status in ("failed", "timed out")
        line = dict(stage=self.name, check=check, status=status, seconds=round(seconds, 1), detail=detail)
        with self.report.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"[{self.name}] {check}: {status}{' - ' + detail if detail else ''}", flush=True)

    @contextmanager
    def check(self, name: str):
        """Time a block and record it: "ok" with the detail the block sets (``detail["text"] = ...``), or
        "failed" with the exception, whose traceback goes to the log. The stage goes on either way."""
        detail, start = {"text": ""}, time.monotonic()
        try:
            yield detail
        except Exception as error:
            traceback.print_exc(file=sys.stdout)
            self.record(name, "failed", f"{type(error).__name__}: {str(error)[:500]}", time.monotonic() - start)
        else:
            self.record(name, detail.get("status", "ok"), detail["text"], time.monotonic() - start)


def read_report(path: Path) -> list[dict]:
    """The checks a stage recorded (a line cut short by a kill is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
