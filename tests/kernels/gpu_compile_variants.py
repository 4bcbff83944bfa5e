"""The launch variants gpu_compile_check.py compiles: for each kvlab kernel, what its launcher would pass it.

Each ``compile_*`` function mirrors one launcher: same argument order, constexprs and num_warps, calling the
launcher's helpers (tile_config, choose_num_partitions, _layer_offsets, module constants) rather than
repeating them. Small CPU tensors with the launch's dtypes and strides go through Triton's own JIT binder
(``kernel.warmup``), so the signature is specialised exactly as for a real launch (16-byte aligned pointers,
ints equal to 1 or divisible by 16); only the compile happens, nothing runs.

Import this only in a process prepared by ``gpu_compile_check.prepare_process`` (interpreter off): the
kernels below are decorated when their modules are first imported.
"""

from dataclasses import dataclass
from unittest import mock

import torch
import triton
import triton.language as tl

from kvlab.kernels.copy_blocks import MAX_TILE_ELEMENTS as COPY_MAX_TILE_ELEMENTS
from kvlab.kernels.copy_blocks import _layer_offsets, copy_blocks_kernel
from kvlab.kernels.paged_attention_decode import DECODE_TILE_N, choose_num_partitions, paged_attention_decode_kernel
from kvlab.kernels.paged_prefill import paged_prefill_kernel, tile_config
from kvlab.kernels.reshape_and_cache import MAX_TILE_ELEMENTS as RESHAPE_MAX_TILE_ELEMENTS
from kvlab.kernels.reshape_and_cache import reshape_and_cache_kernel
from kvlab.kernels.split_k_reduce import split_k_reduce_kernel

if not isinstance(paged_prefill_kernel, triton.runtime.JITFunction):
    raise RuntimeError("kvlab's kernels were built for the Triton interpreter; import this module only after "
                       "gpu_compile_check.prepare_process()")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 128, 256)


@dataclass(frozen=True)
class Attention:
    """One attention launch: ``num_kv_heads`` KV heads, each shared by ``group`` query heads. ``split``: None
    for one partition, else the (num_seqs, context_len) for which the launcher splits the context."""
    dtype: str
    head_dim: int
    group: int = 8
    block_size: int = 16
    split: tuple = None
    window: bool = False
    soft_cap: bool = False

    @property
    def num_kv_heads(self):
        return 8 if self.group > 1 else 32  # Llama-3-70B-like GQA (64 query heads), Llama-2-7B-like MHA

    @property
    def label(self):
        flags = "".join(f"-{name}" for name, on in (("window", self.window), ("softcap", self.soft_cap)) if on)
        split = f"-split{self.split[0]}x{self.split[1]}" if self.split else ""
        return f"{self.dtype}-d{self.head_dim}-g{self.group}-b{self.block_size}{split}{flags}"


LONG, SHORT = (1, 32768), (4, 1024)  # one long sequence: many partitions (CHUNK_P 16); a small batch: a few
# (dtype, head_dim, block_size, num_kv_heads); 64 heads x 256 dims splits heads over the grid (MAX_TILE_ELEMENTS).
COPY_CASES = ([(dtype, head_dim, 16, 8) for dtype in DTYPES for head_dim in HEAD_DIMS]
              + [("fp16", 128, 8, 8), ("bf16", 80, 32, 8), ("fp32", 256, 16, 64)])
# Every dtype x head dim; MHA; block sizes 8 and 32; the window and soft-cap constexprs alone and together
# (soft cap on the largest fp32 tile), and with split-K below.
ATTENTION_CASES = ([Attention(dtype, head_dim) for dtype in DTYPES for head_dim in HEAD_DIMS]
                   + [Attention(dtype, 128, group=1) for dtype in DTYPES]
                   + [Attention("fp16", 128, block_size=8), Attention("bf16", 64, block_size=32),
                      Attention("bf16", 128, group=1, window=True), Attention("fp32", 256, soft_cap=True),
                      Attention("fp16", 80, window=True, soft_cap=True)])
SPLIT_CASES = [Attention("fp16", 128, split=LONG), Attention("bf16", 80, split=SHORT),
               Attention("fp32", 256, split=LONG), Attention("bf16", 256, group=1, split=LONG),
               Attention("fp16", 64, split=SHORT, window=True, soft_cap=True)]

pow2 = triton.next_power_of_2


def _cache(dtype, head_dim, block_size, num_kv_heads):
    return torch.empty(2, 2, block_size, num_kv_heads, head_dim, dtype=DTYPES[dtype])


def compile_reshape_and_cache(dtype, head_dim, block_size, num_kv_heads):
    kv_cache = _cache(dtype, head_dim, block_size, num_kv_heads)
    key, value = (torch.empty(3, num_kv_heads, head_dim, dtype=kv_cache.dtype) for _ in range(2))
    block_d = pow2(head_dim)
    block_h = min(pow2(num_kv_heads), max(1, RESHAPE_MAX_TILE_ELEMENTS // block_d))
    return reshape_and_cache_kernel.warmup(
        key, value, kv_cache, torch.zeros(3, dtype=torch.int64), num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kv_cache.stride()[:4],
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d, grid=(1,))


def compile_copy_blocks(dtype, head_dim, block_size, num_kv_heads):
    layers = [_cache(dtype, head_dim, block_size, num_kv_heads) for _ in range(2)]
    layer_offsets, layer_align = _layer_offsets(layers)
    block_d = pow2(head_dim)
    block_h = min(pow2(num_kv_heads), max(1, COPY_MAX_TILE_ELEMENTS // block_d))
    return copy_blocks_kernel.warmup(
        layers[0], layer_offsets, torch.tensor([[0, 1]]), num_kv_heads, head_dim, *layers[0].stride()[:4],
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d, LAYER_ALIGN=layer_align, grid=(1,))


def _attention_inputs(case, num_query_rows):
    """kv_cache, query, out, block_tables (64 wide: a multiple of 16, as the launcher specialises most tables)
    and the launcher's (scale, soft_cap, sliding_window) scalars."""
    kv_cache = _cache(case.dtype, case.head_dim, case.block_size, case.num_kv_heads)
    query = torch.empty(num_query_rows, case.group * case.num_kv_heads, case.head_dim, dtype=kv_cache.dtype)
    scalars = (case.head_dim ** -0.5, 30.0 if case.soft_cap else 0.0, 4096 if case.window else 0)
    return kv_cache, query, torch.empty_like(query), torch.zeros(2, 64, dtype=torch.int32), scalars


def _num_partitions(case, target):
    if case.split is None:
        return 1
    num_seqs, context_len = case.split
    n = choose_num_partitions(num_seqs, case.num_kv_heads, context_len, target.num_sms)
    assert n > 1, f"{case.label}: choose_num_partitions gave {n} on {target.name}, so it would not split"
    return n


def compile_decode(case, target):
    kv_cache, query, out, block_tables, scalars = _attention_inputs(case, num_query_rows=2)
    parts = _num_partitions(case, target)
    partials = ([torch.empty(2, query.shape[1], parts, *extra) for extra in ((), (), (case.head_dim,))]
                if parts > 1 else [out, out, out])
    block_d = max(16, pow2(case.head_dim))
    return paged_attention_decode_kernel.warmup(
        out, *partials, query, kv_cache, block_tables, torch.ones(2, dtype=torch.int32), *scalars,
        query.shape[1], parts, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], *block_tables.stride(),
        GROUP=case.group, GROUP_PAD=max(16, pow2(case.group)), HEAD_DIM=case.head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=case.block_size, TILE_N=DECODE_TILE_N, USE_WINDOW=case.window, USE_SOFT_CAP=case.soft_cap,
        SPLIT=parts > 1, DOT_PRECISION="ieee" if case.dtype == "fp32" else "tf32",
        num_warps=8 if block_d >= 128 else 4, grid=(1,))


def compile_split_k_reduce(case, target):  # the reduce that follows compile_decode(case, target)
    parts = _num_partitions(case, target)
    out = torch.empty(2, case.group * case.num_kv_heads, case.head_dim, dtype=DTYPES[case.dtype])
    part_max, part_sum = (torch.empty(*out.shape[:2], parts) for _ in range(2))
    part_acc = torch.empty(*out.shape[:2], parts, case.head_dim)
    return split_k_reduce_kernel.warmup(
        out, part_max, part_sum, part_acc, out.shape[1], parts, out.stride(0), out.stride(1),
        HEAD_DIM=case.head_dim, BLOCK_D=pow2(case.head_dim), CHUNK_P=min(16, pow2(parts)), grid=(1,))


def compile_prefill(case, target):
    kv_cache, query, out, block_tables, scalars = _attention_inputs(case, num_query_rows=40)
    block_d = max(16, pow2(case.head_dim))
    # tile_config answers for a CUDA device of the target's compute capability.
    with mock.patch("torch.cuda.get_device_capability", return_value=target.capability):
        rows, tile_n, num_warps = tile_config(query.dtype, block_d, torch.device("cuda"))
    group_pad = pow2(case.group)
    int32 = dict(dtype=torch.int32)
    return paged_prefill_kernel.warmup(
        out, query, kv_cache, block_tables, torch.tensor([50, 60], **int32), torch.tensor([0, 20, 40], **int32),
        torch.zeros(4, 2, **int32), *scalars, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], *block_tables.stride(),
        GROUP=case.group, GROUP_PAD=group_pad, BLOCK_Q=max(1, rows // group_pad), HEAD_DIM=case.head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=case.block_size, TILE_N=tile_n, USE_WINDOW=case.window,
        USE_SOFT_CAP=case.soft_cap, DOT_PRECISION="ieee" if case.dtype == "fp32" else "tf32",
        num_warps=num_warps, grid=(1,))


def kernel_variants(target):
    """(kernel name, variant label, thunk returning its CompiledKernel) for every launch variant. ``target``
    has ``name``, ``capability`` and ``num_sms``."""
    for case in COPY_CASES:
        label = "{}-d{}-b{}-h{}".format(*case)
        yield "reshape_and_cache_kernel", label, lambda case=case: compile_reshape_and_cache(*case)
        yield "copy_blocks_kernel", label, lambda case=case: compile_copy_blocks(*case)
    for case in ATTENTION_CASES + SPLIT_CASES:
        yield "paged_attention_decode_kernel", case.label, lambda case=case: compile_decode(case, target)
    for case in SPLIT_CASES:
        yield "split_k_reduce_kernel", case.label, lambda case=case: compile_split_k_reduce(case, target)
    for case in ATTENTION_CASES:
        yield "paged_prefill_kernel", case.label, lambda case=case: compile_prefill(case, target)


#: A plain Python float, not tl.constexpr: the interpreter accepts it inside a kernel, a GPU build does not.
UNSCALED = 2.0


@triton.jit
def global_constant_kernel(x_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * UNSCALED)


@triton.jit
def spilling_kernel(x_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    # A [128, 256] fp32 tile is 256 values per thread for 4 warps, more than a thread's 255 registers.
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offsets)
    tl.store(x_ptr + offsets, x / tl.sum(x * x, 1)[:, None] + tl.max(x, 0)[None, :])


def broken_variants(target):
    """Kernels with GPU-only bugs the interpreter misses, to show that the check reports them."""
    x = torch.empty(128 * 256)
    yield "global_constant_kernel", "fp32", lambda: global_constant_kernel.warmup(x, BLOCK=128, grid=(1,))
    yield "spilling_kernel", "fp32-128x256", lambda: spilling_kernel.warmup(x, ROWS=128, COLS=256, grid=(1,))
