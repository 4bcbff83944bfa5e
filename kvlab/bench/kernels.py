"""Kernel benchmark (GPU only): ``python -m kvlab.bench kernels [--quick] [--out-dir DIR]``.

For every case it reports the median time (CUDA events, after warm-up, L2 flushed before each rep), the
achieved bandwidth from the bytes the operation *must* move, and that bandwidth as a fraction of the
device's measured copy bandwidth (a large device-to-device copy, read + write). Decode attention is
memory-bound, so its fraction says how close the kernel gets to the hardware; prefill is compute-bound and
its fraction is low by nature.

CSV columns (``data/bench/<gpu-name-slug>.csv``): kernel, impl, dtype, batch, context, num_heads,
num_kv_heads, head_dim, block_size, median_us, gbps, frac_of_copy_bw, gpu. ``batch`` is the number of
sequences for attention, of tokens written for reshape_and_cache and of (src, dst) pairs for copy_blocks
(always ``COPY_LAYERS`` layers); ``context`` is each sequence's length (0 for the cache kernels). Prefill
cases append ``PREFILL_QUERY_LEN`` new tokens to a cached prefix, so context = prefix + new tokens.
"""

import argparse
import csv
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlab.device import ON_GPU
from kvlab.errors import NeedsGPUError

CSV_COLUMNS = ("kernel", "impl", "dtype", "batch", "context", "num_heads", "num_kv_heads", "head_dim",
               "block_size", "median_us", "gbps", "frac_of_copy_bw", "gpu")
PREFILL_QUERY_LEN = 512
COPY_LAYERS = 32
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    kernel: str  # "decode", "prefill", "reshape_and_cache" or "copy_blocks"
    dtype: str   # key of DTYPES
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    block_size: int = 16


def build_grid(quick=False):
    """The cases to run: the full grid, or a handful that finishes in about a minute with ``quick``."""
    heads = [(32, 8)] if quick else [(32, 8), (32, 32)]
    dtypes = ["fp16"] if quick else ["fp16", "bf16"]
    batches = [1, 16] if quick else [1, 4, 16, 64, 256]
    contexts = [512, 4096] if quick else [512, 2048, 8192, 32768]
    prefixes = [1024] if quick else [4096]
    cases = [Case("decode", dt, b, c, h, kvh) for dt in dtypes for h, kvh in heads for b in batches for c in contexts]
    cases += [Case("prefill", dt, b, p + PREFILL_QUERY_LEN, h, kvh)
              for dt in dtypes for h, kvh in heads for b in ([1, 8] if quick else [1, 4, 16]) for p in prefixes]
    cases += [Case("reshape_and_cache", dt, n, 0, 32, 8) for dt in dtypes for n in ([256] if quick else [1, 256, 8192])]
    cases += [Case("copy_blocks", dt, n, 0, 32, 8) for dt in dtypes for n in ([16] if quick else [1, 16, 256])]
    return cases


def decode_bytes(case, itemsize):
    """K and V read once over every sequence's real length, plus the query read and the output written."""
    kv = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim
    q_and_out = 2 * case.batch * case.num_heads * case.head_dim
    return (kv + q_and_out) * itemsize


def prefill_bytes(case, itemsize):
    """K and V read once per sequence (prefix + new tokens), plus the new tokens' queries and outputs."""
    kv = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim
    q_and_out = 2 * case.batch * PREFILL_QUERY_LEN * case.num_heads * case.head_dim
    return (kv + q_and_out) * itemsize


def reshape_and_cache_bytes(case, itemsize):
    """Each token's K and V read from the inputs and written into its slot."""
    return 2 * 2 * case.batch * case.num_kv_heads * case.head_dim * itemsize


def copy_blocks_bytes(case, itemsize):
    """Every pair reads one block and writes one block (K and V) in each of COPY_LAYERS layers."""
    block = 2 * case.block_size * case.num_kv_heads * case.head_dim * itemsize
    return 2 * case.batch * COPY_LAYERS * block


BYTES_MOVED = {"decode": decode_bytes, "prefill": prefill_bytes, "reshape_and_cache": reshape_and_cache_bytes,
               "copy_blocks": copy_blocks_bytes}


def gpu_slug(name):
    """File-name-safe GPU name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def make_row(case, impl, median_us, copy_gbps, gpu):
    """One CSV row; bandwidth from the case's required bytes, fraction of the measured copy bandwidth."""
    gbps = BYTES_MOVED[case.kernel](case, DTYPES[case.dtype].itemsize) / (median_us * 1e-6) / 1e9
    return {**asdict(case), "impl": impl, "median_us": round(median_us, 2), "gbps": round(gbps, 1),
            "frac_of_copy_bw": round(gbps / copy_gbps, 3), "gpu": gpu}


def write_csv(rows, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def require_gpu():
    if not ON_GPU:
        raise NeedsGPUError("the kernel benchmark needs a CUDA GPU: in interpreter mode (no GPU, or "
                            "TRITON_INTERPRET=1) kernel timings mean nothing. Run it on a machine with an NVIDIA GPU.")


# ---- GPU-only part: timing --------------------------------------------------------------------------------


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


def measure_copy_gbps(timer, nbytes=1 << 30):
    """Device copy bandwidth, counting read + write like the kernels' byte counts do."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer.median_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


# ---- inputs and implementations (run on CUDA; the pure-torch parts are tested on CPU) ---------------------


def paged_inputs(case, device="cuda"):
    """A cache holding ``batch`` sequences of ``context`` tokens in shuffled blocks, its block tables and
    seq_lens, the queries (1 per sequence for decode, PREFILL_QUERY_LEN for prefill) and cu_query_lens."""
    dtype, q_len = DTYPES[case.dtype], (1 if case.kernel == "decode" else PREFILL_QUERY_LEN)
    blocks_per_seq = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_seq
    kv_cache = torch.randn(num_blocks, 2, case.block_size, case.num_kv_heads, case.head_dim, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(case.batch, blocks_per_seq)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    query = torch.randn(case.batch * q_len, case.num_heads, case.head_dim, dtype=dtype, device=device)
    cu_query_lens = torch.arange(0, case.batch + 1, dtype=torch.int32, device=device) * q_len
    return kv_cache, block_tables, seq_lens, query, cu_query_lens


def contiguous_kv(kv_cache, block_tables, seq_len):
    """The no-paging baseline's K, V ``[batch, num_kv_heads, seq_len, head_dim]`` (gathered once, not timed)."""
    k, v = (kv_cache[block_tables.long(), i].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous() for i in (0, 1))
    return k, v


def sdpa_contiguous(case, query, kv_cache, block_tables):
    """The no-paging baseline: torch SDPA over K/V gathered once into contiguous tensors (not timed).
    Returns a callable giving ``[batch, num_heads, q_len, head_dim]``."""
    q_len = query.shape[0] // case.batch
    k, v = contiguous_kv(kv_cache, block_tables, case.context)
    q = query.view(case.batch, q_len, case.num_heads, case.head_dim).transpose(1, 2)
    mask = None
    if q_len > 1:
        from torch.nn.attention.bias import causal_lower_right  # new tokens sit at the end of the context
        mask = causal_lower_right(q_len, case.context)
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=case.num_heads != case.num_kv_heads)


def attention_impls(case):
    """{impl name: zero-argument callable} for one decode or prefill case; peers that fail to import or set
    up are reported and skipped."""
    q_len = 1 if case.kernel == "decode" else PREFILL_QUERY_LEN
    kv_cache, block_tables, seq_lens, query, cu_query_lens = paged_inputs(case)
    impls = {}
    if case.kernel == "decode":
        from kvlab.kernels.paged_attention_decode import paged_attention_decode
        impls["kvlab"] = lambda: paged_attention_decode(query, kv_cache, block_tables, seq_lens)
    else:
        from kvlab.kernels.paged_prefill import paged_prefill
        impls["kvlab"] = lambda: paged_prefill(query, kv_cache, block_tables, seq_lens, cu_query_lens)

    impls["torch_sdpa_contiguous"] = sdpa_contiguous(case, query, kv_cache, block_tables)
    try:
        impls["flashinfer"] = flashinfer_impl(case, query, kv_cache, block_tables, cu_query_lens, q_len)
    except Exception as error:  # optional peer: absent or an incompatible version
        print(f"  flashinfer skipped: {type(error).__name__}: {error}", file=sys.stderr)
    return impls


def flashinfer_impl(case, query, kv_cache, block_tables, cu_query_lens, q_len):
    """flashinfer's paged wrappers read our cache layout as is ("NHD": [pages, 2, page_size, heads, dim])."""
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    blocks_per_seq = block_tables.shape[1]
    indptr = torch.arange(0, case.batch + 1, dtype=torch.int32, device="cuda") * blocks_per_seq
    indices = block_tables.flatten().contiguous()
    last_page_len = torch.full((case.batch,), (case.context - 1) % case.block_size + 1, dtype=torch.int32,
                               device="cuda")
    shape = (case.num_heads, case.num_kv_heads, case.head_dim, case.block_size)
    if q_len == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last_page_len, *shape, data_type=query.dtype)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(cu_query_lens, indptr, indices, last_page_len, *shape, causal=True, q_data_type=query.dtype)
    return lambda: wrapper.run(query, kv_cache)


def cache_op_impls(case):
    """{impl name: callable} for reshape_and_cache or copy_blocks: the Triton kernel and a plain torch peer."""
    dtype = DTYPES[case.dtype]
    from kvlab.kernels.cache import allocate_kv_cache
    if case.kernel == "reshape_and_cache":
        from kvlab.kernels.reshape_and_cache import reshape_and_cache
        num_blocks = 2 * (-(-case.batch // case.block_size))
        (kv_cache,) = allocate_kv_cache(1, case.num_kv_heads, case.head_dim, block_size=case.block_size, dtype=dtype,
                                        device="cuda", num_blocks=num_blocks)
        key, value = (torch.randn(case.batch, case.num_kv_heads, case.head_dim, dtype=dtype, device="cuda")
                      for _ in range(2))
        slots = torch.randperm(num_blocks * case.block_size, device="cuda")[:case.batch]
        blocks, offsets = slots // case.block_size, slots % case.block_size

        def torch_scatter():
            kv_cache[blocks, 0, offsets] = key
            kv_cache[blocks, 1, offsets] = value
        return {"kvlab": lambda: reshape_and_cache(key, value, kv_cache, slots), "torch_index_put": torch_scatter}

    from kvlab.kernels.copy_blocks import copy_blocks
    kv_caches = allocate_kv_cache(COPY_LAYERS, case.num_kv_heads, case.head_dim, block_size=case.block_size,
                                  dtype=dtype, device="cuda", num_blocks=2 * case.batch)
    pairs = torch.randperm(2 * case.batch, device="cuda").view(-1, 2)  # disjoint srcs and dsts

    def torch_per_layer():
        for kv_cache in kv_caches:
            kv_cache[pairs[:, 1]] = kv_cache[pairs[:, 0]]
    return {"kvlab": lambda: copy_blocks(kv_caches, pairs), "torch_per_layer": torch_per_layer}


def fits(case, free_bytes):
    """Skip cases whose cache (plus the baseline's contiguous copy) would not fit comfortably."""
    if case.kernel not in ("decode", "prefill"):
        return True
    cache = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim * DTYPES[case.dtype].itemsize
    return 2 * cache < 0.7 * free_bytes


def run(cases, out_dir):
    from tqdm.auto import tqdm

    gpu = torch.cuda.get_device_name()
    timer = Timer()
    copy_gbps = measure_copy_gbps(timer)
    print(f"{gpu}: device copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    rows = []
    for case in tqdm(cases, desc="kernel cases"):
        if not fits(case, torch.cuda.mem_get_info()[0]):
            print(f"skip (does not fit in GPU memory): {case}")
            continue
        impls = attention_impls(case) if case.kernel in ("decode", "prefill") else cache_op_impls(case)
        for impl, fn in impls.items():
            row = make_row(case, impl, timer.median_us(fn), copy_gbps, gpu)
            rows.append(row)
            print(f"{case.kernel:>18} {impl:>22} {case.dtype} b={case.batch:<4} ctx={case.context:<6} "
                  f"h={case.num_heads}/{case.num_kv_heads}: {row['median_us']:>9.1f} us {row['gbps']:>7.1f} GB/s "
                  f"({row['frac_of_copy_bw']:.0%} of copy)")
        del impls
        torch.cuda.empty_cache()
    return write_csv(rows, Path(out_dir) / f"{gpu_slug(gpu)}.csv")


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
