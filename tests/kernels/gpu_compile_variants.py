"""The launch variants gpu_compile_check.py compiles: for each kvlab kernel, what its launcher would pass it.

Every launch decision (grid, num_warps, constexprs, split-K partitions) comes from the kernel module's own
config function (``decode_launch_config``, ``prefill_launch_config``, ``split_k_reduce_config``,
``reshape_and_cache_config``, ``copy_blocks_config``, ``mla_launch_config``), the one its launcher calls, given
the target's compute capability and SM count; only the runtime arguments are built here. Small CPU tensors with
the launch's dtypes and strides go through Triton's own JIT binder (``kernel.warmup``), so the signature is
specialised exactly as for a real launch (16-byte aligned pointers, ints equal to 1 or divisible by 16); only the
compile happens, nothing runs.

Import this only in a process prepared by ``gpu_compile_check.prepare_process`` (interpreter off): the
kernels below are decorated when their modules are first imported.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvlab.kernels.copy_blocks import _layer_offsets, copy_blocks_config, copy_blocks_kernel
from kvlab.kernels.kivi_paged_attention import kivi_launch_config, kivi_paged_attention_kernel
from kvlab.kernels.kivi_seal import FP16_MAX, kivi_seal_config, kivi_seal_kernel
from kvlab.kernels.kv_quant import MIN_SCALE, KVQuantizer
from kvlab.kernels.mla_decode import PRE_AMPERE_MAX_KV_LORA_RANK, mla_decode_kernel, mla_launch_config
from kvlab.kernels.paged_attention_decode import GPU_TILE_N, decode_launch_config, paged_attention_decode_kernel
from kvlab.kernels.paged_prefill import paged_prefill_kernel, prefill_launch_config
from kvlab.kernels.reshape_and_cache import reshape_and_cache_config, reshape_and_cache_kernel
from kvlab.kernels.split_k_reduce import split_k_reduce_config, split_k_reduce_kernel
from kvlab.sizing.kv_dtypes import kivi_value_group

if not isinstance(paged_prefill_kernel, triton.runtime.JITFunction):
    raise RuntimeError("kvlab's kernels were built for the Triton interpreter; import this module only after "
                       "gpu_compile_check.prepare_process()")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 128, 256)
SLIDING_WINDOW, SOFT_CAP = 4096, 30.0  # values for the variants that turn these options on


@dataclass(frozen=True)
class Attention:
    """One attention launch: ``num_kv_heads`` KV heads, each shared by ``group`` query heads. ``split``: None
    for one partition, else the (num_seqs, context_len) for which the launcher's heuristic splits the
    context."""
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
    def num_heads(self):
        return self.group * self.num_kv_heads

    @property
    def options(self):
        """The launcher's ``sliding_window`` and ``soft_cap`` arguments."""
        return dict(sliding_window=SLIDING_WINDOW if self.window else None,
                    soft_cap=SOFT_CAP if self.soft_cap else None)

    @property
    def label(self):
        flags = "".join(f"-{name}" for name, on in (("window", self.window), ("softcap", self.soft_cap)) if on)
        split = f"-split{self.split[0]}x{self.split[1]}" if self.split else ""
        return f"{self.dtype}-d{self.head_dim}-g{self.group}-b{self.block_size}{split}{flags}"


LONG, SHORT = (1, 32768), (4, 1024)  # one long sequence: many partitions (CHUNK_P 16); a small batch: a few
# (dtype, head_dim, block_size, num_kv_heads); 64 heads x 256 dims splits heads over the grid (MAX_TILE_ELEMENTS).
# Then the other block sizes (1 to 128: copy_blocks loops over a block's slots) with head dims at the ends of the
# supported range and padded ones (17: rows no longer 16-byte aligned; 24 and 200 on tiles of 32 and 256).
COPY_CASES = ([(dtype, head_dim, 16, 8) for dtype in DTYPES for head_dim in HEAD_DIMS]
              + [("fp16", 128, 8, 8), ("bf16", 80, 32, 8), ("fp32", 256, 16, 64)]
              + [("fp16", 16, 1, 8), ("bf16", 17, 2, 8), ("fp32", 24, 4, 8), ("fp16", 200, 64, 8),
                 ("fp32", 16, 128, 8)])
# Every dtype x head dim; MHA; block sizes 8 and 32; the window and soft-cap constexprs alone and together
# (soft cap on the largest fp32 tile), and with split-K below. Then head dim 16 (the smallest tl.dot operand:
# BLOCK_D 16) in every dtype and the unaligned 17, over block sizes 1 to 128 (split-K: block sizes 4 and 128).
ATTENTION_CASES = ([Attention(dtype, head_dim) for dtype in DTYPES for head_dim in HEAD_DIMS]
                   + [Attention(dtype, 128, group=1) for dtype in DTYPES]
                   + [Attention("fp16", 128, block_size=8), Attention("bf16", 64, block_size=32),
                      Attention("bf16", 128, group=1, window=True), Attention("fp32", 256, soft_cap=True),
                      Attention("fp16", 80, window=True, soft_cap=True)]
                   + [Attention("fp16", 16, block_size=1), Attention("fp32", 16, block_size=128),
                      Attention("bf16", 16, group=1, block_size=64), Attention("fp16", 17, block_size=2, window=True)])
SPLIT_CASES = [Attention("fp16", 128, split=LONG), Attention("bf16", 80, split=SHORT),
               Attention("fp32", 256, split=LONG), Attention("bf16", 256, group=1, split=LONG),
               Attention("fp16", 64, split=SHORT, window=True, soft_cap=True),
               Attention("fp32", 16, block_size=128, split=SHORT), Attention("fp16", 17, block_size=4, split=LONG)]


# MLA decode: (dtype, kv_lora_rank, rope_dim, num_heads, block_size). DeepSeek-V3's 512 + 64 latent with its 128
# heads in every dtype and V2-Lite's 16 heads (not before Ampere: the launcher refuses them there); then smaller
# and padded latents (17 + 6 on tiles of 32 + 16), and head counts that leave a head tile partly empty, over
# block sizes 1 to 128.
MLA_CASES = ([(dtype, 512, 64, 128, 16) for dtype in DTYPES]
             + [("bf16", 512, 64, 16, 64), ("fp16", 256, 32, 20, 1), ("fp32", 256, 32, 16, 16),
                ("fp32", 32, 16, 4, 128), ("fp16", 17, 6, 5, 2)])


# KIVI (kivi_seal, kivi_paged_attention): (format, head_dim, block_size = R); the paper's G 32 and 128 at 4 and
# 2 bits, over head dims 64 to 256 and block sizes 16 to 128 (G 16: the smallest group and R).
KIVI_CASES = [("kivi_int4", 128, 128), ("kivi_int2", 128, 32), ("kivi_int4_g128", 256, 128), ("kivi_int2", 64, 64),
              ("kivi_int4_g16", 64, 16), ("kivi_int2_g128", 128, 128)]
# The reads: every query dtype with GQA 4 (decode and prefill), MHA, and GQA 8 at head_dim 256.
KIVI_READS = ([(dtype, case, 4) for dtype in DTYPES for case in KIVI_CASES[:3]]
              + [("fp16", KIVI_CASES[3], 1), ("bf16", KIVI_CASES[4], 8), ("fp32", KIVI_CASES[5], 8)])


def compile_kivi_seal(name, head_dim, block_size):
    """``kivi_seal``'s launch (``kivi_seal_config``) for 8 KV heads."""
    quantizer = KVQuantizer(name, head_dim)
    bits, group = quantizer.kivi
    cache = torch.empty(2, 2, block_size, 8, quantizer.storage_width, dtype=torch.uint8)
    key, slots = torch.empty(group, 8, head_dim), torch.zeros(group, dtype=torch.int64)
    return kivi_seal_kernel.warmup(
        key, key, slots, slots, cache, 8, *cache.stride()[:4], D=head_dim, G=group, BITS=bits,
        VG=kivi_value_group(head_dim, group), W=quantizer.storage_width, MIN_SCALE_=MIN_SCALE, FP16_MAX_=FP16_MAX,
        grid=(1,), **kivi_seal_config(head_dim, group))


def compile_kivi_read(dtype, case, group, decode, target):
    """``kivi_paged_attention``'s launch (``kivi_launch_config``) of 8 KV heads x ``group`` query heads."""
    name, head_dim, block_size = case
    quantizer = KVQuantizer(name, head_dim, residual_length=block_size)
    cache = torch.empty(2, 2, block_size, 8, quantizer.storage_width, dtype=torch.uint8)
    query = torch.empty(40, 8 * group, head_dim, dtype=DTYPES[dtype])
    out, open_kv = torch.empty_like(query), torch.empty(2, 2, 64, 8, head_dim, dtype=query.dtype)
    block_tables, int32 = torch.zeros(2, 64, dtype=torch.int32), dict(dtype=torch.int32)
    config = kivi_launch_config(8 * group, 8, quantizer, block_size, query.dtype, decode, target.capability)
    return kivi_paged_attention_kernel.warmup(
        out, query, cache, block_tables, torch.tensor([50, 60], **int32), torch.tensor([0, 20, 40], **int32),
        torch.zeros(4, 2, **int32), open_kv, head_dim ** -0.5, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), *cache.stride()[:4], *block_tables.stride(), *open_kv.stride()[:4], grid=(1,), **config)


def _cache(dtype, head_dim, block_size, num_kv_heads):
    return torch.empty(2, 2, block_size, num_kv_heads, head_dim, dtype=DTYPES[dtype])


def compile_reshape_and_cache(dtype, head_dim, block_size, num_kv_heads):
    kv_cache = _cache(dtype, head_dim, block_size, num_kv_heads)
    key, value = (torch.empty(3, num_kv_heads, head_dim, dtype=kv_cache.dtype) for _ in range(2))
    return reshape_and_cache_kernel.warmup(
        key, value, kv_cache, torch.zeros(3, dtype=torch.int64), num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kv_cache.stride()[:4],
        **reshape_and_cache_config(key.shape[0], num_kv_heads, head_dim, block_size))


def compile_copy_blocks(dtype, head_dim, block_size, num_kv_heads):
    layers = [_cache(dtype, head_dim, block_size, num_kv_heads) for _ in range(2)]
    layer_offsets, layer_align = _layer_offsets(layers)
    return copy_blocks_kernel.warmup(
        layers[0], layer_offsets, torch.tensor([[0, 1]]), num_kv_heads, head_dim, *layers[0].stride()[:4],
        **copy_blocks_config(1, len(layers), num_kv_heads, head_dim, block_size, layer_align))


def _attention_inputs(case, num_query_rows):
    """kv_cache, query, out, block_tables (64 wide: a multiple of 16, as the launcher specialises most tables)
    and the launcher's (scale, soft_cap, sliding_window) scalars."""
    kv_cache = _cache(case.dtype, case.head_dim, case.block_size, case.num_kv_heads)
    query = torch.empty(num_query_rows, case.num_heads, case.head_dim, dtype=kv_cache.dtype)
    scalars = (case.head_dim ** -0.5, SOFT_CAP if case.soft_cap else 0.0, SLIDING_WINDOW if case.window else 0)
    return kv_cache, query, torch.empty_like(query), torch.zeros(2, 64, dtype=torch.int32), scalars


def decode_config(case, target):
    """``decode_launch_config`` for ``case`` on ``target``: split-K by the launcher's heuristic for split cases
    (which must then split), one partition otherwise."""
    num_seqs, context_len = case.split or (2, 1024)
    config = decode_launch_config(
        num_seqs, case.num_heads, case.num_kv_heads, case.head_dim, case.block_size, DTYPES[case.dtype],
        context_len, split_k=None if case.split else False, capability=target.capability,
        num_sms=target.num_sms, **case.options)
    assert config["SPLIT"] == bool(case.split), f"{case.label}: the heuristic gave {config['grid'][2]} " \
                                                f"partitions on {target.name}"
    return config


def compile_decode(case, target, **override):
    """The decode launch for ``case`` on ``target``; ``override`` replaces config entries (broken_variants)."""
    kv_cache, query, out, block_tables, scalars = _attention_inputs(case, num_query_rows=2)
    config = {**decode_config(case, target), **override}
    parts = config["grid"][2]
    partials = ([torch.empty(2, case.num_heads, parts, *extra) for extra in ((), (), (case.head_dim,))]
                if config["SPLIT"] else [out, out, out])
    return paged_attention_decode_kernel.warmup(
        out, *partials, query, kv_cache, block_tables, torch.ones(2, dtype=torch.int32), *scalars,
        query.shape[1], parts, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], *block_tables.stride(), **config)


def compile_split_k_reduce(case, target):  # the reduce that follows compile_decode(case, target)
    parts = decode_config(case, target)["grid"][2]
    out = torch.empty(2, case.num_heads, case.head_dim, dtype=DTYPES[case.dtype])
    part_max, part_sum = (torch.empty(*out.shape[:2], parts) for _ in range(2))
    part_acc = torch.empty(*out.shape[:2], parts, case.head_dim)
    return split_k_reduce_kernel.warmup(
        out, part_max, part_sum, part_acc, out.shape[1], parts, out.stride(0), out.stride(1),
        **split_k_reduce_config(out.shape[0], out.shape[1], parts, case.head_dim))


def compile_prefill(case, target):
    kv_cache, query, out, block_tables, scalars = _attention_inputs(case, num_query_rows=40)
    config = prefill_launch_config(case.num_heads, case.num_kv_heads, case.head_dim, case.block_size,
                                   DTYPES[case.dtype], target.capability, **case.options)
    int32 = dict(dtype=torch.int32)
    return paged_prefill_kernel.warmup(
        out, query, kv_cache, block_tables, torch.tensor([50, 60], **int32), torch.tensor([0, 20, 40], **int32),
        torch.zeros(4, 2, **int32), *scalars, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], *block_tables.stride(), grid=(1,), **config)


def compile_mla_decode(dtype, kv_lora_rank, rope_dim, num_heads, block_size):
    latent_cache = torch.empty(2, block_size, kv_lora_rank + rope_dim, dtype=DTYPES[dtype])
    query = torch.empty(2, num_heads, kv_lora_rank + rope_dim, dtype=latent_cache.dtype)
    out = torch.empty(2, num_heads, kv_lora_rank, dtype=latent_cache.dtype)
    block_tables = torch.zeros(2, 64, dtype=torch.int32)
    return mla_decode_kernel.warmup(
        out, query, latent_cache, block_tables, torch.ones(2, dtype=torch.int32), 192 ** -0.5, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *latent_cache.stride()[:2],
        *block_tables.stride(),
        **mla_launch_config(2, num_heads, kv_lora_rank, rope_dim, block_size, latent_cache.dtype))


def kernel_variants(target):
    """(kernel name, variant label, thunk returning its CompiledKernel) for every launch variant the launchers
    allow on ``target`` (``name``, ``capability``, ``num_sms``, ``bf16``): no bf16 where the GPU lacks it."""
    def allowed(dtype):
        return dtype != "bf16" or target.bf16

    for case in COPY_CASES:
        if allowed(case[0]):
            label = "{}-d{}-b{}-h{}".format(*case)
            yield "reshape_and_cache_kernel", label, lambda case=case: compile_reshape_and_cache(*case)
            yield "copy_blocks_kernel", label, lambda case=case: compile_copy_blocks(*case)
    attention = [case for case in ATTENTION_CASES if allowed(case.dtype)]
    splits = [case for case in SPLIT_CASES if allowed(case.dtype)]
    for case in attention + splits:
        yield "paged_attention_decode_kernel", case.label, lambda case=case: compile_decode(case, target)
    for case in splits:
        yield "split_k_reduce_kernel", case.label, lambda case=case: compile_split_k_reduce(case, target)
    for case in attention:
        yield "paged_prefill_kernel", case.label, lambda case=case: compile_prefill(case, target)
    for case in KIVI_CASES + [("kivi_int4", 80, 32), ("kivi_int2_g16", 96, 64)]:  # and head dims not a power of 2
        yield "kivi_seal_kernel", "{}-d{}-b{}".format(*case), lambda case=case: compile_kivi_seal(*case)
    for dtype, case, group in KIVI_READS:
        if allowed(dtype):
            for decode in (True, False):
                label = "{}-{}-d{}-b{}-g{}-{}".format(dtype, *case, group, "decode" if decode else "prefill")
                yield ("kivi_paged_attention_kernel", label,
                       lambda dtype=dtype, case=case, group=group, decode=decode:
                       compile_kivi_read(dtype, case, group, decode, target))
    for case in MLA_CASES:  # the launcher refuses kv_lora_rank > 256 before Ampere (mla_decode's docstring)
        if allowed(case[0]) and (case[1] <= PRE_AMPERE_MAX_KV_LORA_RANK or target.capability >= (8, 0)):
            label = "{}-r{}+{}-h{}-b{}".format(*case)
            yield "mla_decode_kernel", label, lambda case=case: compile_mla_decode(*case)


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
    """Kernels with GPU-only bugs the interpreter misses, to show that the check reports them. The last is a
    real launch gone wrong: decode before ``decode_launch_config`` halved TILE_N for fp32 head_dim 256 on
    pre-Ampere GPUs, which asks a T4 (sm_75, 64 KiB) for 80 KiB of shared memory (an H100 has room for it)."""
    x = torch.empty(128 * 256)
    yield "global_constant_kernel", "fp32", lambda: global_constant_kernel.warmup(x, BLOCK=128, grid=(1,))
    yield "spilling_kernel", "fp32-128x256", lambda: spilling_kernel.warmup(x, ROWS=128, COLS=256, grid=(1,))
    case = Attention("fp32", 256)
    yield ("paged_attention_decode_kernel", f"{case.label}-tile{GPU_TILE_N}",
           lambda: compile_decode(case, target, TILE_N=GPU_TILE_N))
