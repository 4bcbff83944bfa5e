"""Stage kernels: the kernel benchmark (kvlab/bench/kernels.py) into ``<gpu-name-slug>.csv``, as
``data/bench/`` holds it: decode (split-K automatic, forced on, forced off), prefill over cached prefixes,
reshape_and_cache, copy_blocks and swaps, beside torch SDPA on a contiguous copy and FlexAttention with a
paged block mask (and FlashInfer where installed). The quick grid runs first, then the rest of the full grid,
so that a run cut short by the time box still covers every kernel. The dry run times a few tiny cases on CPU
with a wall clock: the path, not a figure."""

import csv
import time
from dataclasses import fields

from kvlab.bench.kernels import Case, build_grid, run as run_grid

FIELDS = [f.name for f in fields(Case)]
INT_FIELDS = {f.name for f in fields(Case) if f.type is int}

#: Tiny cases for the dry run: every kernel and every implementation, in the interpreter.
DRY_RUN_CASES = [Case("decode", "fp16", 2, 40, 4, 2, head_dim=32),
                 Case("prefill", "fp16", 2, 20, 4, 2, head_dim=32, query_len=8),
                 Case("decode", "fp8_e4m3", 2, 40, 4, 2, head_dim=32),  # fp8 reads run in the interpreter;
                 Case("prefill", "fp8_e4m3", 2, 20, 4, 2, head_dim=32, query_len=8),
                 Case("reshape_and_cache", "fp16", 8, 0, 4, 2, head_dim=32),  # its fp8 writes do not (GPU only)
                 Case("copy_blocks", "fp16", 2, 0, 4, 2, head_dim=32, block_size=4),
                 Case("swap_out", "fp16", 3, 0, 4, 2, head_dim=32), Case("swap_in", "fp16", 3, 0, 4, 2, head_dim=32)]


def run_book_grid():
    """The quick grid, then what the full grid adds."""
    quick = build_grid(quick=True)
    return quick + [case for case in build_grid() if case not in set(quick)]


def run(stage):
    cases = DRY_RUN_CASES if stage.dry_run else run_book_grid()
    failures = []
    with stage.check("kernel benchmark") as detail:
        path = run_grid(cases, stage.out, dry_run=stage.dry_run, deadline=stage.deadline, failures=failures)
        with path.open() as f:
            rows = list(csv.DictReader(f))
        covered = {tuple(int(row[k]) if k in INT_FIELDS else row[k] for k in FIELDS) for row in rows}
        missing = [c for c in cases if tuple(getattr(c, k) for k in FIELDS) not in covered]
        detail["text"] = (f"{len(rows)} rows in {path.name}; {len(cases) - len(missing)} of {len(cases)} cases; "
                          f"impls: {', '.join(sorted({row['impl'] for row in rows}))}")
        if missing and time.monotonic() > stage.deadline:
            detail.update(status="timed out", text=detail["text"] + f"; {len(missing)} cases left out: out of time")
    for line in failures:
        stage.record("kernel benchmark: an implementation", "failed", line)
