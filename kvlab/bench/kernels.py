"""Kernel benchmark (GPU only): ``python -m kvlab.bench kernels [--quick] [--out-dir DIR]``.

For every case it reports the median time (CUDA events, after warm-up, L2 flushed before each rep), the
achieved bandwidth from the bytes the operation *must* move, and that bandwidth as a fraction of the
device's measured copy bandwidth (a large device-to-device copy, read + write). Decode attention is
memory-bound, so its fraction says how close the kernel gets to the hardware; prefill is compute-bound and
its fraction is low by nature.

CSV columns (``data/bench/<gpu-name-slug>.csv``): kernel, impl, dtype, batch, context, num_heads,
num_kv_heads, head_dim, block_size, query_len, median_us, gbps, frac_of_copy_bw, gpu. ``dtype`` is the cache's:
fp8_e4m3 / fp8_e5m2 rows (decode, prefill and reshape_and_cache) read or write an fp8 cache with fp16 queries
and new K/V, their bytes counted at 1 byte per cached element: set them beside the fp16 rows of the same case to see
what the smaller cache buys in time (the same bandwidth would halve the time). ``batch`` is the number of
sequences for attention, of tokens written for reshape_and_cache, of (src, dst) pairs for copy_blocks
(always ``COPY_LAYERS`` layers) and of blocks moved for swap_out / swap_in (one layer, device <-> host);
``context`` is each sequence's length (0 for the cache kernels). Prefill cases append ``query_len`` new
tokens (``PREFILL_QUERY_LEN`` in the grid) to a cached prefix, so context = prefix + new tokens. Swaps cross
the host link, so their fraction is of the measured pinned host <-> device copy in the same direction, not of
the device copy.
Cases: kernel_cases.py; implementations: kernel_impls.py.
"""

import argparse
import csv
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlab.bench.kernel_cases import COPY_LAYERS, DTYPES, FP8, PREFILL_QUERY_LEN, Case, io_dtype
from kvlab.device import ON_GPU
from kvlab.errors import NeedsGPUError

CSV_COLUMNS = ("kernel", "impl", "dtype", "batch", "context", "num_heads", "num_kv_heads", "head_dim",
               "block_size", "query_len", "median_us", "gbps", "frac_of_copy_bw", "gpu")


def build_grid(quick=False):
    """The cases to run: the full grid, or a handful that finishes in about a minute with ``quick``. Prefill
    runs over several cached-prefix lengths (0 = a prompt with no prefix hit)."""
    heads = [(32, 8)] if quick else [(32, 8), (32, 32)]
    dtypes = ["fp16"] if quick else ["fp16", "bf16"]
    batches = [1, 16] if quick else [1, 4, 16, 64, 256]
    contexts = [512, 4096] if quick else [512, 2048, 8192, 32768]
    prefixes = [1024] if quick else [0, 1024, 4096, 16384]
    prefill_batches = [1, 8] if quick else [1, 16]
    cases = [Case("decode", dt, b, c, h, kvh) for dt in dtypes for h, kvh in heads for b in batches for c in contexts]
    cases += [Case("prefill", dt, b, p + PREFILL_QUERY_LEN, h, kvh)
              for dt in dtypes for h, kvh in heads for b in prefill_batches for p in prefixes]
    # fp8 caches beside the fp16 cases of the same shapes (quick: e4m3 at the largest batch and context or
    # prefix only)
    fp8 = FP8[:1] if quick else FP8
    decode_shapes = [(batches[-1], contexts[-1])] if quick else [(b, c) for b in batches for c in contexts]
    prefill_shapes = [(prefill_batches[-1], prefixes[-1])] if quick else [(b, p) for b in prefill_batches
                                                                          for p in prefixes]
    cases += [Case("decode", dt, b, c, 32, 8) for dt in fp8 for b, c in decode_shapes]
    cases += [Case("prefill", dt, b, p + PREFILL_QUERY_LEN, 32, 8) for dt in fp8 for b, p in prefill_shapes]
    cases += [Case("reshape_and_cache", dt, n, 0, 32, 8) for dt in dtypes + list(fp8)
              for n in ([256] if quick else [1, 256, 8192])]
    cases += [Case("copy_blocks", dt, n, 0, 32, 8) for dt in dtypes for n in ([16] if quick else [1, 16, 256])]
    cases += [Case(swap, dt, n, 0, 32, 8) for swap in ("swap_out", "swap_in") for dt in dtypes
              for n in ([64] if quick else [16, 1024])]
    return cases


def decode_bytes(case, itemsize):
    """K and V read once over every sequence's real length (``itemsize``: the cache's), plus the query read and
    the output written (in ``io_dtype``)."""
    kv = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim
    q_and_out = 2 * case.batch * case.num_heads * case.head_dim
    return kv * itemsize + q_and_out * io_dtype(case.dtype).itemsize


def prefill_bytes(case, itemsize):
    """K and V read once per sequence (prefix + new tokens; ``itemsize``: the cache's), plus the new tokens'
    queries and outputs (in ``io_dtype``)."""
    kv = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim
    q_and_out = 2 * case.batch * case.query_len * case.num_heads * case.head_dim
    return kv * itemsize + q_and_out * io_dtype(case.dtype).itemsize


def reshape_and_cache_bytes(case, itemsize):
    """Each token's K and V read from the inputs (in ``io_dtype``) and written into its slot (``itemsize``)."""
    return 2 * case.batch * case.num_kv_heads * case.head_dim * (itemsize + io_dtype(case.dtype).itemsize)


def copy_blocks_bytes(case, itemsize):
    """Every pair reads one block and writes one block (K and V) in each of COPY_LAYERS layers."""
    block = 2 * case.block_size * case.num_kv_heads * case.head_dim * itemsize
    return 2 * case.batch * COPY_LAYERS * block


def swap_bytes(case, itemsize):
    """Every block (K and V) crosses the host link once."""
    return case.batch * 2 * case.block_size * case.num_kv_heads * case.head_dim * itemsize


BYTES_MOVED = {"decode": decode_bytes, "prefill": prefill_bytes, "reshape_and_cache": reshape_and_cache_bytes,
               "copy_blocks": copy_blocks_bytes, "swap_out": swap_bytes, "swap_in": swap_bytes}


def gpu_slug(name):
    """File-name-safe GPU name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def make_row(case, impl, median_us, copy_gbps, gpu):
    """One CSV row; bandwidth from the case's required bytes, fraction of ``copy_gbps``, the ceiling measured
    for that kind of copy (``Ceilings.for_case``)."""
    gbps = BYTES_MOVED[case.kernel](case, DTYPES[case.dtype].itemsize) / (median_us * 1e-6) / 1e9
    return {**asdict(case), "impl": impl, "median_us": round(median_us, 2), "gbps": round(gbps, 1),
            "frac_of_copy_bw": round(gbps / copy_gbps, 3), "gpu": gpu}


def write_csv(rows, path):
    with RowWriter(path) as write:
        for row in rows:
            write(row)
    return Path(path)


class RowWriter:
    """The CSV header at once, then each row flushed as it comes, so a run stopped half way (a time box, a
    crash) keeps every row it finished."""

    def __init__(self, path):
        self.path = Path(path)

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS)
        self.writer.writeheader()
        self.file.flush()
        return self

    def __call__(self, row):
        self.writer.writerow(row)
        self.file.flush()

    def __exit__(self, *exc):
        self.file.close()


def require_gpu():
    if not ON_GPU:
        raise NeedsGPUError("the kernel benchmark needs a CUDA GPU: in interpreter mode (no GPU, or "
                            "TRITON_INTERPRET=1) kernel timings mean nothing. Run it on a machine with an NVIDIA GPU.")


# ---- timing ----------------------------------------------------------------------------------------------


class Timer:
    """Median CUDA-event time of a callable; a buffer larger than L2 is overwritten before each rep so
    every rep starts with a cold cache (the flush itself is outside the timed events)."""

    def __init__(self, warmup=3, reps=20):
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        self.flush_buffer = torch.empty(max(4 * l2_bytes, 256 << 20), dtype=torch.uint8, device="cuda")
        self.warmup, self.reps = warmup, reps

    def median_us(self, fn):
        for _ in range(self.warmup):
            fn()
        events = []
        for _ in range(self.reps):
            self.flush_buffer.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return 1000.0 * statistics.median(start.elapsed_time(end) for start, end in events)


class WallTimer:
    """The dry run's stand-in for ``Timer`` on CPU (kernels in the interpreter): the same calls, a wall clock.
    Its numbers only prove the path ran; they say nothing about any GPU."""

    def __init__(self, warmup=1, reps=2):
        self.warmup, self.reps = warmup, reps

    def median_us(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)


def measure_copy_gbps(timer, nbytes=1 << 30, device="cuda"):
    """Device copy bandwidth, counting read + write like the kernels' byte counts do."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer.median_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def measure_link_gbps(timer, direction, nbytes=256 << 20, device="cuda"):
    """Host link bandwidth, device -> pinned host ("out") or back ("in"), counting the bytes once like
    ``swap_bytes``."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    src, dst = (on_device, host) if direction == "out" else (host, on_device)
    return nbytes / (timer.median_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


@dataclass
class Ceilings:
    copy_gbps: float   # device -> device, read + write
    out_gbps: float    # device -> pinned host
    in_gbps: float     # pinned host -> device

    @classmethod
    def measure(cls, timer, device="cuda", nbytes=1 << 30):
        return cls(measure_copy_gbps(timer, nbytes, device), measure_link_gbps(timer, "out", nbytes // 4, device),
                   measure_link_gbps(timer, "in", nbytes // 4, device))

    def for_case(self, case):
        return {"swap_out": self.out_gbps, "swap_in": self.in_gbps}.get(case.kernel, self.copy_gbps)


def fits(case, free_bytes):
    """Skip cases whose cache (plus the baselines' copies: SDPA's contiguous one, FlexAttention's) would not
    fit comfortably."""
    if case.kernel not in ("decode", "prefill"):
        return True
    cache = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim * DTYPES[case.dtype].itemsize
    return 3 * cache < 0.7 * free_bytes


#: The ``gpu`` column of a dry run (CPU, interpreter): never mistaken for a GPU's row.
DRY_RUN_LABEL = "dry run on CPU (Triton interpreter)"


def run(cases, out_dir, *, dry_run=False, deadline=None, failures=None):
    """Time every case and write ``<out_dir>/<gpu-name-slug>.csv``, row by row; returns its path.

    ``deadline`` (``time.monotonic()`` seconds): cases not started by then are left out, and said so.
    ``failures``: a list that gets one line per implementation that raised (the others go on).
    ``dry_run``: the same path on CPU with the kernels in the interpreter and ``WallTimer``, for CI."""
    from tqdm.auto import tqdm

    from kvlab.bench.kernel_impls import attention_impls, cache_op_impls

    device, gpu = ("cpu", DRY_RUN_LABEL) if dry_run else ("cuda", torch.cuda.get_device_name())
    timer = WallTimer() if dry_run else Timer()
    ceilings = Ceilings.measure(timer, device, nbytes=(1 << 20) if dry_run else (1 << 30))
    print(f"{gpu}: device copy {ceilings.copy_gbps:.0f} GB/s (read + write), to host {ceilings.out_gbps:.1f} GB/s, "
          f"from host {ceilings.in_gbps:.1f} GB/s")
    path = Path(out_dir) / f"{gpu_slug(gpu)}.csv"
    with RowWriter(path) as write:
        for done, case in enumerate(tqdm(cases, desc="kernel cases")):
            if deadline is not None and time.monotonic() > deadline:
                print(f"out of time: {len(cases) - done} of {len(cases)} cases not run")
                break
            if not dry_run and not fits(case, torch.cuda.mem_get_info()[0]):
                print(f"skip (does not fit in GPU memory): {case}")
                continue
            impls = (attention_impls(case, device) if case.kernel in ("decode", "prefill")
                     else cache_op_impls(case, device))
            for impl, fn in impls.items():
                try:
                    median_us = timer.median_us(fn)
                except Exception as error:  # one implementation failing (a peer's compiler, say) spares the rest
                    line = f"{case.kernel} {impl} {case}: {type(error).__name__}: {str(error)[:300]}"
                    print(f"FAILED {line}", file=sys.stderr)
                    if failures is not None:
                        failures.append(line)
                    continue
                row = make_row(case, impl, median_us, ceilings.for_case(case), gpu)
                write(row)
                print(f"{case.kernel:>18} {impl:>22} {case.dtype} b={case.batch:<4} ctx={case.context:<6} "
                      f"h={case.num_heads}/{case.num_kv_heads}: {row['median_us']:>9.1f} us {row['gbps']:>7.1f} GB/s "
                      f"({row['frac_of_copy_bw']:.0%} of copy)")
            del impls
            if not dry_run:
                torch.cuda.empty_cache()
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    parser.add_argument("--out-dir", default="data/bench", help="where to write <gpu-name-slug>.csv")
    args = parser.parse_args(argv)
    try:
        require_gpu()
    except NeedsGPUError as error:
        print(f"kvlab kernel benchmark: {error}", file=sys.stderr)
        return 2
    path = run(build_grid(args.quick), args.out_dir)
    print(f"wrote {path}")
    return 0
