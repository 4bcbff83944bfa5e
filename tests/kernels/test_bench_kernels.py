"""The CPU-testable parts of the kernel benchmark: byte counts, grid, rows, CSV, GPU slug and the refusal
to run without a GPU. (The timing path needs CUDA and is exercised by running the benchmark itself.)"""

import csv

import pytest
import torch

from kvlab.bench import kernel_impls, kernels as bench
from kvlab.device import ON_GPU
from kvlab.kernels.reference import paged_attention_decode_ref, paged_prefill_ref

DECODE = bench.Case("decode", "fp16", batch=4, context=1000, num_heads=32, num_kv_heads=8)


def test_decode_bytes_read_kv_once_plus_query_and_output():
    kv = 2 * 4 * 1000 * 8 * 128 * 2          # K and V, every sequence's real length, fp16
    q_and_out = 2 * 4 * 32 * 128 * 2
    assert bench.decode_bytes(DECODE, 2) == kv + q_and_out


def test_prefill_bytes_count_new_tokens_queries():
    case = bench.Case("prefill", "bf16", batch=2, context=4096 + bench.PREFILL_QUERY_LEN, num_heads=32, num_kv_heads=8)
    kv = 2 * 2 * (4096 + bench.PREFILL_QUERY_LEN) * 8 * 128 * 2
    q_and_out = 2 * 2 * bench.PREFILL_QUERY_LEN * 32 * 128 * 2
    assert bench.prefill_bytes(case, 2) == kv + q_and_out


def test_cache_kernel_bytes():
    write = bench.Case("reshape_and_cache", "fp16", batch=100, context=0, num_heads=32, num_kv_heads=8)
    assert bench.reshape_and_cache_bytes(write, 2) == 100 * 2 * 8 * 128 * 2 * 2  # K+V, read + write
    copy = bench.Case("copy_blocks", "fp16", batch=3, context=0, num_heads=32, num_kv_heads=8)
    block = 2 * 16 * 8 * 128 * 2
    assert bench.copy_blocks_bytes(copy, 2) == 3 * bench.COPY_LAYERS * block * 2


def test_fp8_bytes_count_the_cache_at_one_byte_and_the_rest_in_fp16():
    case = bench.Case("decode", "fp8_e4m3", batch=4, context=1000, num_heads=32, num_kv_heads=8)
    assert bench.decode_bytes(case, 1) == 2 * 4 * 1000 * 8 * 128 * 1 + 2 * 4 * 32 * 128 * 2
    write = bench.Case("reshape_and_cache", "fp8_e5m2", batch=100, context=0, num_heads=32, num_kv_heads=8)
    assert bench.reshape_and_cache_bytes(write, 1) == 100 * 2 * 8 * 128 * (2 + 1)  # read fp16, write fp8
    gbps = bench.decode_bytes(case, 1) / 1e-3 / 1e9
    assert bench.make_row(case, "kvlab", 1000.0, gbps, "gpu")["gbps"] == pytest.approx(gbps, abs=0.1)
    prefill = bench.Case("prefill", "fp8_e4m3", batch=2, context=1024 + bench.PREFILL_QUERY_LEN, num_heads=32,
                         num_kv_heads=8)
    kv, q_and_out = 2 * 2 * 1536 * 8 * 128, 2 * 2 * bench.PREFILL_QUERY_LEN * 32 * 128
    assert bench.prefill_bytes(prefill, 1) == kv * 1 + q_and_out * 2  # the cache in fp8, queries and output fp16


def test_grid_covers_the_brief_and_quick_is_small():
    full = bench.build_grid()
    decode = [c for c in full if c.kernel == "decode"]
    assert {c.batch for c in decode} == {1, 4, 16, 64, 256}
    assert {c.context for c in decode} == {512, 2048, 8192, 32768}
    assert {(c.num_heads, c.num_kv_heads) for c in decode} == {(32, 8), (32, 32)}
    assert {c.dtype for c in full} == {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"}
    fp8 = {(c.kernel, c.batch, c.context) for c in full if c.dtype == "fp8_e5m2"}  # each beside its fp16 case
    assert fp8 <= {(c.kernel, c.batch, c.context) for c in full if c.dtype == "fp16"}
    assert {kernel for kernel, _, _ in fp8} == {"decode", "prefill", "reshape_and_cache"}
    prefill = {(c.batch, c.context) for c in full if c.kernel == "prefill"}
    assert {(c.batch, c.context) for c in full if c.kernel == "prefill" and c.dtype == "fp8_e4m3"} == prefill
    assert {c.head_dim for c in full} == {128} and {c.block_size for c in full} == {16}
    assert {c.kernel for c in full} == {"decode", "prefill", "reshape_and_cache", "copy_blocks", "swap_out", "swap_in"}
    assert {c.context - c.query_len for c in full if c.kernel == "prefill"} == {0, 1024, 4096, 16384}
    assert len(set(full)) == len(full)
    quick = bench.build_grid(quick=True)
    assert {c.kernel for c in quick} == {c.kernel for c in full} and len(quick) <= 13
    assert {c.kernel for c in quick if c.dtype == "fp8_e4m3"} == {"decode", "prefill", "reshape_and_cache"}


def test_row_and_csv(tmp_path):
    # 1 ms for the decode case's bytes, device copy at twice that rate
    gbps = bench.decode_bytes(DECODE, 2) / 1e-3 / 1e9
    row = bench.make_row(DECODE, "kvlab", 1000.0, 2 * gbps, "NVIDIA H100 80GB HBM3")
    assert row["gbps"] == pytest.approx(gbps, abs=0.1) and row["frac_of_copy_bw"] == 0.5
    path = bench.write_csv([row, row], tmp_path / "nested" / "gpu.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == bench.CSV_COLUMNS
    assert len(rows) == 2 and rows[0]["impl"] == "kvlab" and rows[0]["context"] == "1000"


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
                                        ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
                                        ("Tesla T4 (PCIe)", "tesla-t4-pcie"), ("", "unknown-gpu")])
def test_gpu_slug(name, slug):
    assert bench.gpu_slug(name) == slug


def test_fits_skips_caches_too_big_for_memory():
    assert bench.fits(DECODE, free_bytes=10 << 30)
    assert not bench.fits(DECODE, free_bytes=bench.decode_bytes(DECODE, 2))
    assert bench.fits(bench.Case("copy_blocks", "fp16", 1, 0, 32, 8), free_bytes=0)


@pytest.mark.skipif(ON_GPU, reason="checks the refusal on machines without a GPU")
def test_main_refuses_without_a_gpu(capsys, tmp_path):
    assert bench.main(["--quick", "--out-dir", str(tmp_path)]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kernel, context", [("decode", 37), ("prefill", bench.PREFILL_QUERY_LEN + 21)])
def test_sdpa_baseline_does_the_same_attention_as_the_reference(kernel, context):
    # The baseline's timing only compares with the kernel's if it computes the same thing; fp16 inputs,
    # compared in fp32 against the reference on the same paged K/V.
    case = bench.Case(kernel, "fp16", batch=2, context=context, num_heads=4, num_kv_heads=2, head_dim=32)
    kv_cache, block_tables, seq_lens, query, cu_query_lens = kernel_impls.paged_inputs(case, device="cpu")
    kv_cache, query = kv_cache.float(), query.float()
    out = kernel_impls.sdpa_contiguous(case, query, kv_cache, block_tables)()     # [batch, heads, q_len, dim]
    out = out.transpose(1, 2).reshape(query.shape)
    if kernel == "decode":
        expected = paged_attention_decode_ref(query, kv_cache, block_tables, seq_lens)
    else:
        expected = paged_prefill_ref(query, kv_cache, block_tables, seq_lens, cu_query_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel, context, query_len", [("decode", 37, 1), ("prefill", 29, 8), ("prefill", 8, 8)])
def test_flex_paged_block_mask_does_the_same_attention_as_the_reference(kernel, context, query_len):
    # FlexAttention reads kvlab's shuffled pages through the block mask: eager on CPU, the same mask a GPU
    # compiles. Block size 4 puts several pages, full and partial, in every row.
    case = bench.Case(kernel, "fp16", batch=2, context=context, num_heads=4, num_kv_heads=2, head_dim=32,
                      block_size=4, query_len=query_len)
    kv_cache, block_tables, seq_lens, query, cu_query_lens = kernel_impls.paged_inputs(case, device="cpu")
    kv_cache, query = kv_cache.float(), query.float()
    out = kernel_impls.flex_paged(case, query, kv_cache, block_tables, seq_lens)()
    out = out.transpose(1, 2).reshape(query.shape)
    if kernel == "decode":
        expected = paged_attention_decode_ref(query, kv_cache, block_tables, seq_lens)
    else:
        expected = paged_prefill_ref(query, kv_cache, block_tables, seq_lens, cu_query_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_swap_bytes_and_ceilings():
    swap = bench.Case("swap_out", "bf16", batch=10, context=0, num_heads=32, num_kv_heads=8)
    assert bench.swap_bytes(swap, 2) == 10 * 2 * 16 * 8 * 128 * 2  # each block once over the link
    ceilings = bench.Ceilings(copy_gbps=3000.0, out_gbps=50.0, in_gbps=40.0)
    assert ceilings.for_case(swap) == 50.0 and ceilings.for_case(DECODE) == 3000.0
