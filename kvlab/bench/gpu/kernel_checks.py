"""Kernel checks at sizes only a GPU affords (contexts to 32k, batch 256, head dims 64/128/256, fp16 and bf16,
block sizes 16/32/128), each against its torch twin in ``kvlab.kernels.reference``, plus a race check: the
kernel run again on the same inputs must give the same bits (a moving result means a race or a read of
memory nothing wrote). Caches are NaN wherever no sequence lives, so a stray read shows as NaN.

``shrink`` turns every check into a tiny one with the same geometry for the dry run (the interpreter) and
for ``small_launches`` (one launch of each kernel under compute-sanitizer)."""

import math
from dataclasses import dataclass, replace

import torch

from kvlab.bench.kernels import DTYPES

DTYPES = {**DTYPES, "fp32": torch.float32}
#: ||out - ref|| / ||ref|| allowed: both round the output; the kernel also rounds p before P @ V.
REL_TOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 2e-2}


@dataclass(frozen=True)
class Check:
    kernel: str          # decode, prefill, reshape_and_cache, copy_blocks, swap_out, swap_in, kivi_seal,
    #                      kivi_decode, kivi_prefill
    dtype: str
    head_dim: int
    block_size: int
    batch: int = 1       # sequences; tokens for reshape_and_cache; pairs / blocks for the copies
    context: int = 0     # tokens per sequence (attention)
    q_len: int = 1       # new tokens per sequence (prefill)
    num_heads: int = 32
    num_kv_heads: int = 8
    layers: int = 1      # copy_blocks
    split_k: bool | None = None  # decode: None = the launcher's choice; True keeps split-K on once shrunk
    kv_format: str | None = None  # the KIVI kernels' cache format (R = block_size: a full block is sealed chunks)

    @property
    def name(self):
        sizes = (f"b{self.batch}" + (f" ctx{self.context}" if self.context else "")
                 + (f" q{self.q_len}" if self.kernel == "prefill" else "")
                 + (f" x{self.layers} layers" if self.layers > 1 else "") + (" split-K" if self.split_k else ""))
        return (f"{self.kernel} {sizes} h{self.num_heads}/{self.num_kv_heads} d{self.head_dim} "
                f"bs{self.block_size} {self.dtype}" + (f" {self.kv_format}" if self.kv_format else ""))


GPU_CHECKS = [
    Check("decode", "bf16", 128, 16, batch=256, context=2048),
    Check("decode", "fp16", 128, 16, batch=4, context=32768),
    Check("decode", "fp16", 64, 32, batch=64, context=4096, num_heads=16),
    Check("decode", "bf16", 256, 128, batch=8, context=16384, num_heads=8, num_kv_heads=1),
    Check("decode", "bf16", 128, 128, batch=1, context=32768, split_k=True),
    Check("prefill", "bf16", 128, 16, batch=1, context=32768, q_len=512),
    Check("prefill", "fp16", 64, 32, batch=16, context=4096, q_len=256, num_heads=16),
    Check("prefill", "bf16", 256, 128, batch=4, context=8192, q_len=128, num_heads=8, num_kv_heads=1),
    Check("reshape_and_cache", "fp16", 64, 32, batch=8192),
    Check("reshape_and_cache", "bf16", 128, 16, batch=8192),
    Check("reshape_and_cache", "bf16", 256, 128, batch=8192, num_kv_heads=1),
    Check("copy_blocks", "bf16", 128, 16, batch=256, layers=28),
    Check("copy_blocks", "fp16", 256, 128, batch=64, layers=28, num_kv_heads=1),
    Check("swap_out", "fp16", 128, 16, batch=512),
    Check("swap_in", "bf16", 128, 128, batch=64),
    # kivi_seal (kvlab.kernels.kivi_seal): batch tokens of fp32 K/V quantized, whole key groups of 32, into a
    # KIVI cache, against KVQuantizer.encode's bytes
    Check("kivi_seal", "fp32", 128, 128, batch=8192, kv_format="kivi_int4"),
    Check("kivi_seal", "fp32", 64, 32, batch=8192, num_kv_heads=4, kv_format="kivi_int2"),
    # kivi_paged_attention (kvlab.kernels.kivi_paged_attention): decode and prefix prefill over KIVI pages and
    # each query's full-precision chunk, against kivi_read_torch (R = block_size, KIVI's 128 at bs 128); the
    # first of each, shrunk, is the dry run's and the sanitizer's (small: the interpreter dequantizes slowly)
    Check("kivi_decode", "fp16", 64, 32, batch=256, context=4096, num_heads=8, num_kv_heads=2,
          kv_format="kivi_int2"),
    Check("kivi_decode", "fp16", 128, 128, batch=64, context=8192, kv_format="kivi_int4"),
    Check("kivi_prefill", "fp16", 64, 32, batch=8, context=2048, q_len=200, num_heads=8, num_kv_heads=2,
          kv_format="kivi_int2"),
    Check("kivi_prefill", "bf16", 128, 128, batch=4, context=8192, q_len=512, kv_format="kivi_int4"),
]
#: The checks whose output is attention (compared within a tolerance; the others must match bit for bit).
ATTENTION_KERNELS = ("decode", "prefill", "kivi_decode", "kivi_prefill")


def shrink(check):
    """The same geometry at interpreter sizes; bf16 attention becomes fp16 (the interpreter computes bf16
    wrongly, so the kernels refuse it there)."""
    dtype = "fp16" if check.dtype == "bf16" and check.kernel in ATTENTION_KERNELS else check.dtype
    q_len = min(check.q_len, 5)
    return replace(check, dtype=dtype, batch=min(check.batch, 3), q_len=q_len, layers=min(check.layers, 2),
                   context=min(check.context, check.block_size + 7 + q_len) if check.context else 0)


def nan_cache(num_blocks, check, device):
    return torch.full((num_blocks, 2, check.block_size, check.num_kv_heads, check.head_dim), math.nan,
                      dtype=DTYPES[check.dtype], device=device)


def attention_inputs(check, device):
    """Sequences of ``context`` random tokens in shuffled blocks of a NaN cache with spare blocks; queries."""
    dtype, per_seq = DTYPES[check.dtype], -(-check.context // check.block_size)
    num_blocks = check.batch * per_seq + 4
    kv_cache = nan_cache(num_blocks, check, device)
    tables = torch.randperm(num_blocks, device=device)[:check.batch * per_seq].view(check.batch, per_seq)
    positions = torch.arange(check.context, device=device)
    blocks, offsets = tables[:, positions // check.block_size], positions % check.block_size
    kv_cache[blocks, :, offsets] = torch.randn(check.batch, check.context, 2, check.num_kv_heads, check.head_dim,
                                               device=device).to(dtype)
    seq_lens = torch.full((check.batch,), check.context, dtype=torch.int32, device=device)
    query = torch.randn(check.batch * check.q_len, check.num_heads, check.head_dim, device=device).to(dtype)
    cu_query_lens = torch.arange(check.batch + 1, dtype=torch.int32, device=device) * check.q_len
    return query, kv_cache, tables.to(torch.int32), seq_lens, cu_query_lens


def kernel_and_twin(check, device):
    """(run the kernel, run its twin): each returns a fresh output tensor from the same inputs (the cache
    kernels write into a fresh clone of their target each time)."""
    from kvlab.kernels import copy_blocks, paged_attention_decode, paged_prefill, reshape_and_cache, swap_blocks
    from kvlab.kernels import reference as ref

    if check.kernel in ("decode", "prefill"):
        query, kv_cache, tables, seq_lens, cu = attention_inputs(check, device)
        if check.kernel == "decode":
            return (lambda: paged_attention_decode(query, kv_cache, tables, seq_lens, split_k=check.split_k),
                    lambda: ref.paged_attention_decode_ref(query, kv_cache, tables, seq_lens))
        return (lambda: paged_prefill(query, kv_cache, tables, seq_lens, cu),
                lambda: ref.paged_prefill_ref(query, kv_cache, tables, seq_lens, cu))
    dtype = DTYPES[check.dtype]
    if check.kernel == "kivi_seal":
        return kivi_seal_and_twin(check, device)
    if check.kernel in ("kivi_decode", "kivi_prefill"):
        return kivi_read_and_twin(check, device)
    if check.kernel == "reshape_and_cache":
        num_blocks = 2 * -(-check.batch // check.block_size)
        key, value = (torch.randn(check.batch, check.num_kv_heads, check.head_dim, device=device).to(dtype)
                      for _ in range(2))
        slots = torch.randperm(num_blocks * check.block_size, device=device)[:check.batch]
        target = nan_cache(num_blocks, check, device)
        return (lambda: reshape_and_cache(key, value, target.clone(), slots),
                lambda: ref.reshape_and_cache_ref(key, value, target.clone(), slots))
    if check.kernel == "copy_blocks":
        caches = [torch.randn(2 * check.batch, 2, check.block_size, check.num_kv_heads, check.head_dim,
                              device=device).to(dtype) for _ in range(check.layers)]
        pairs = torch.randperm(2 * check.batch, device=device).view(-1, 2)
        return (lambda: torch.stack(copy_blocks([c.clone() for c in caches], pairs)),
                lambda: torch.stack(ref.copy_blocks_ref([c.clone() for c in caches], pairs)))
    on_device = torch.randn(2 * check.batch, 2, check.block_size, check.num_kv_heads, check.head_dim,
                            device=device).to(dtype)
    src, dst = (on_device, on_device.cpu()) if check.kernel == "swap_out" else (on_device.cpu(), on_device)
    pairs = torch.stack([torch.randperm(2 * check.batch)[:check.batch],
                         torch.randperm(2 * check.batch)[:check.batch]], 1)
    return (lambda: swap_blocks(src, torch.full_like(dst, math.nan), pairs),
            lambda: ref.swap_blocks_ref(src, torch.full_like(dst, math.nan), pairs))


def kivi_seal_and_twin(check, device):
    """``kivi_seal`` of ``batch`` tokens (rounded up to whole key groups) into random slots of a poisoned (0xFF)
    cache of ``check.kv_format``, and the torch twin's bytes there."""
    from kvlab.kernels.kivi_seal import kivi_seal
    from kvlab.kernels.kv_quant import KVQuantizer

    quantizer = KVQuantizer(check.kv_format, check.head_dim)
    group = quantizer.kivi[1]
    tokens = -(-check.batch // group) * group
    num_blocks = 2 * -(-tokens // check.block_size)
    key, value = (torch.randn(tokens, check.num_kv_heads, check.head_dim, device=device) for _ in range(2))
    slots = torch.randperm(num_blocks * check.block_size, device=device)[:tokens]
    blocks, offsets = slots // check.block_size, slots % check.block_size
    target = torch.full((num_blocks, 2, check.block_size, check.num_kv_heads, quantizer.storage_width), 0xFF,
                        dtype=torch.uint8, device=device)

    def twin():
        out = target.clone()
        out[blocks, :, offsets] = quantizer.encode(key, value).unflatten(-1, (2, -1)).transpose(1, 2)
        return out

    return lambda: kivi_seal(key, value, target.clone(), blocks, offsets, quantizer), twin


def kivi_read_and_twin(check, device):
    """``kivi_paged_attention`` over ``batch`` sequences of ``context`` tokens in shuffled blocks of a poisoned
    (0xFF: NaN scales) cache of ``check.kv_format``, their whole R-chunks sealed (``KVQuantizer.encode``'s
    bytes), each one's open chunk in full precision, and its twin ``kivi_read_torch``."""
    from kvlab.kernels.kivi_paged_attention import kivi_paged_attention
    from kvlab.kernels.kv_quant import KVQuantizer
    from kvlab.kernels.torch_paged import plan_paged_attention
    from kvlab.kernels.torch_paged_quant import kivi_read_torch, plan_kivi_step

    R, dtype = check.block_size, DTYPES[check.dtype]
    quantizer = KVQuantizer(check.kv_format, check.head_dim, residual_length=R)
    per_seq = -(-check.context // check.block_size)
    num_blocks = check.batch * per_seq + 4
    kv_cache = torch.full((num_blocks, 2, check.block_size, check.num_kv_heads, quantizer.storage_width), 0xFF,
                          dtype=torch.uint8, device=device)
    tables = torch.randperm(num_blocks, device=device)[:check.batch * per_seq].view(check.batch, per_seq)
    key, value = (torch.randn(check.batch, check.context, check.num_kv_heads, check.head_dim, device=device)
                  for _ in range(2))
    key[..., 1] *= 10                                                   # an outlier channel, as KIVI's keys have
    positions = torch.arange(check.context // R * R, device=device)     # the sealed chunks
    records = quantizer.encode(key[:, positions], value[:, positions])  # [batch, sealed, H_kv, 2 W]
    kv_cache[tables[:, positions // check.block_size], :, positions % check.block_size] = \
        records.unflatten(-1, (2, -1)).transpose(-3, -2)
    decode = check.kernel == "kivi_decode"
    q_len = 1 if decode else check.q_len
    open_start = (check.context - q_len) // R * R
    open_kv = torch.stack((key, value))[:, :, open_start:].to(dtype)   # [2, batch, C, H_kv, D]
    query = torch.randn(check.batch * q_len, check.num_heads, check.head_dim, device=device).to(dtype)
    seq_lens = torch.full((check.batch,), check.context, dtype=torch.int32, device=device)
    cu_query_lens = torch.arange(check.batch + 1, dtype=torch.int32, device=device) * q_len
    tables = tables.to(torch.int32)
    cu = None if decode else cu_query_lens

    def twin():
        plan = plan_paged_attention(kv_cache, tables, seq_lens, cu_query_lens, query.shape[0])
        step = plan_kivi_step(plan, tables, seq_lens, cu, check.block_size, R, quantizer.kivi[1])
        return kivi_read_torch(query, kv_cache, step, quantizer, open_kv)

    return lambda: kivi_paged_attention(query, kv_cache, tables, seq_lens, cu, open_kv, quantizer), twin


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def accuracy(check, out, expected):
    """A detail line; raises AssertionError when the kernel's output is off its twin's."""
    if check.kernel not in ATTENTION_KERNELS:  # copies and the KIVI seal's bytes: nothing may differ
        assert torch.equal(bits(out), bits(expected)), "differs bitwise from the torch twin"
        return "bitwise equal to the torch twin"
    assert torch.isfinite(out).all(), "NaN/inf in the output: memory that no sequence owns was read"
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= REL_TOL[check.dtype], f"||out - ref|| / ||ref|| = {err:.2e} > {REL_TOL[check.dtype]:.0e}"
    return f"rel err {err:.1e} (tol {REL_TOL[check.dtype]:.0e})"


def same_bits(first, second):
    """The race check: two runs of a kernel on the same inputs."""
    assert torch.equal(bits(first), bits(second)), \
        f"two runs on the same inputs differ in {int((bits(first) != bits(second)).sum())} elements"
    return "two runs bitwise equal"
