"""The batched torch path (kvlab.kernels.torch_paged) against kvlab.kernels.reference and the Triton kernels, on
the same NaN-poisoned cases as the kernel tests: every GQA ratio, block size and head dim of CONFIGS and
GEOMETRIES, sequences of different lengths in one batch (padding), prefix hits, no new tokens, sliding
windows that drop blocks, soft cap, strided inputs, bf16 on CPU; the same bad input raises the same errors."""

import pytest
import torch
from attention_cases import CONFIGS, F16, F32, GEOMETRIES, assert_close, build_case, strided_block_tables

from kvlab.device import DEVICE
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import paged_attention_decode, paged_prefill, reshape_and_cache
from kvlab.kernels.reference import paged_attention_decode_ref, paged_prefill_ref, reshape_and_cache_ref
from kvlab.kernels.torch_paged import (merge_split_k, paged_attention_decode_torch, paged_attention_torch,
                                       paged_prefill_torch, plan_paged_attention, reshape_and_cache_torch,
                                       split_k_partitions)

# (seq_len, q_len) as in test_paged_prefill: a prefix hit, a 1-token sequence, a full prefill, a sequence with
# no new tokens, one new token, a long prefix with many new tokens. Unequal lengths: rows are padded.
SEQS = [(37, 10), (1, 1), (45, 45), (29, 0), (70, 1), (53, 20)]
SEQ_LENS = [37, 1, 70, 16]


@pytest.fixture
def case(make_cache, random_block_tables):
    def build(seqs=SEQS, **kwargs):
        seq_lens, q_lens = (list(x) for x in zip(*seqs))
        c = build_case(make_cache, random_block_tables, seq_lens=seq_lens, q_lens=q_lens, **kwargs)
        return c, (*c.args(), c.cu_query_lens)
    return build


@pytest.fixture
def decode_case(make_cache, random_block_tables):
    return lambda **kwargs: build_case(make_cache, random_block_tables, **kwargs)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, dtype, layout", CONFIGS + GEOMETRIES)
def test_decode_matches_reference(decode_case, num_heads, num_kv_heads, head_dim, block_size, dtype, layout):
    c = decode_case(seq_lens=SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size, dtype=dtype, layout=layout, strided_query=layout != "contiguous")
    assert_close(paged_attention_decode_torch(*c.args()), paged_attention_decode_ref(*c.args()))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, dtype, layout", CONFIGS + GEOMETRIES)
def test_prefill_matches_reference(case, num_heads, num_kv_heads, head_dim, block_size, dtype, layout):
    _, args = case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                   dtype=dtype, layout=layout, strided_query=layout != "contiguous")
    assert_close(paged_prefill_torch(*args), paged_prefill_ref(*args))


@pytest.mark.parametrize("sliding_window, soft_cap, scale", [
    (1, None, None), (6, None, None), (21, None, None), (500, None, None),
    (None, 2.0, None), (None, 30.0, 0.5), (9, 1.5, 0.3)])
def test_window_soft_cap_and_scale(case, sliding_window, soft_cap, scale):
    c, args = case(num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    assert_close(paged_prefill_torch(*args, **options), paged_prefill_ref(*args, **options))
    decode = (c.query[:4], c.kv_cache, c.block_tables[:4], c.seq_lens[:4])
    assert_close(paged_attention_decode_torch(*decode, **options), paged_attention_decode_ref(*decode, **options))


def test_blocks_before_the_window_are_never_read(case):
    # As for the kernels: table entries wholly before every query's window point at an all-NaN spare block.
    block_size, window = 8, 10
    c, args = case(seqs=[(61, 3), (40, 1), (33, 33)], num_heads=4, num_kv_heads=2, head_dim=64,
                   block_size=block_size, dtype=F16)
    expected = paged_prefill_ref(*args, sliding_window=window)
    used = {int(b) for s, n in enumerate(c.seq_lens.tolist()) for b in c.block_tables[s, :-(-n // block_size)]}
    spare = next(b for b in range(c.kv_cache.shape[0]) if b not in used)
    q_lens = (c.cu_query_lens[1:] - c.cu_query_lens[:-1]).tolist()
    for s, (n, q_len) in enumerate(zip(c.seq_lens.tolist(), q_lens)):
        c.block_tables[s, :max(0, n - q_len - window + 1) // block_size] = spare
    assert (c.block_tables == spare).any()
    assert_close(paged_prefill_torch(*args, sliding_window=window), expected)


def test_matches_the_triton_kernels(case, make_cache, randn, random_slot_mapping, assert_bitwise_equal):
    """Tiny shapes (the kernels run in the interpreter on CPU): write then attend, both ways, same answer."""
    c, args = case(seqs=[(19, 7), (5, 5), (12, 1)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                   dtype=F32)
    ours, theirs = make_cache(12, 4, 2, 32, F32), make_cache(12, 4, 2, 32, F32)
    key, value = randn(9, 2, 32), randn(9, 2, 32)
    slots = random_slot_mapping(9, 12 * 4, num_skipped=2)
    reshape_and_cache_torch(key, value, ours, slots)
    reshape_and_cache(key, value, theirs, slots)
    assert_bitwise_equal(ours, theirs)
    torch.testing.assert_close(paged_prefill_torch(*args), paged_prefill(*args), atol=1e-5, rtol=1e-5)
    decode = c.args()[0][:3], *c.args()[1:]
    torch.testing.assert_close(paged_attention_decode_torch(*decode), paged_attention_decode(*decode),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "padded", "kv_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_matches_reference_and_touches_only_its_slots(make_cache, randn, random_slot_mapping,
                                                           assert_bitwise_equal, layout, dtype):
    cache = make_cache(7, 8, 3, 48, dtype, layout)
    expected = cache.clone()
    qkv = randn(20, 9, 48, dtype=dtype)  # strided key and value, as sliced from a fused projection
    key, value, slots = qkv[:, 3:6], qkv[:, 6:], random_slot_mapping(20, 56, num_skipped=3)
    assert reshape_and_cache_torch(key, value, cache, slots) is cache
    reshape_and_cache_ref(key, value, expected, slots)
    assert_bitwise_equal(cache, expected)  # NaN poison outside the written slots is kept bit for bit


def test_head_major_blocks(case, randn):
    """A layout the conftest lacks: each block stored [2, H_kv, block_size, D], so a slot's heads are far apart
    and the rows of ``row_view`` overlap. Reads and writes still land where the reference puts them."""
    c, (q, cache, tables, lens, cu) = case(num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=F32)
    head_major = cache.transpose(2, 3).contiguous().transpose(2, 3)
    assert head_major.stride(3) > head_major.stride(2)
    assert_close(paged_prefill_torch(q, head_major, tables, lens, cu), paged_prefill_ref(q, cache, tables, lens, cu))
    key, value, slots = randn(5, 2, 32), randn(5, 2, 32), torch.tensor([3, -1, 17, 40, 8], device=DEVICE)
    reshape_and_cache_torch(key, value, head_major, slots)
    reshape_and_cache_ref(key, value, cache, slots)
    assert torch.equal(head_major.nan_to_num(7.0), cache.nan_to_num(7.0))


def test_bf16_runs_on_cpu(case):
    # The interpreter computes bf16 wrongly, torch does not: this path takes it (the kernels refuse it on CPU).
    _, args = case(seqs=[(21, 6), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    q, cache, *rest = args
    bf16 = (q.bfloat16(), cache.bfloat16(), *rest)
    assert_close(paged_prefill_torch(*bf16), paged_prefill_ref(*bf16))


def test_strided_tables_empty_batches_and_no_new_tokens(case):
    c, (q, cache, tables, lens, cu) = case(num_heads=2, num_kv_heads=1, head_dim=80, block_size=8, dtype=F32)
    strided = strided_block_tables(tables)
    assert_close(paged_prefill_torch(q, cache, strided, lens, cu), paged_prefill_ref(q, cache, tables, lens, cu))
    assert paged_attention_decode_torch(q[:0], cache, tables[:0], lens[:0]).shape == (0, 2, 80)
    no_new = torch.zeros(len(SEQS) + 1, dtype=torch.int32, device=DEVICE)
    assert paged_prefill_torch(q[:0], cache, tables, lens, no_new).shape == (0, 2, 80)


def test_one_plan_serves_every_layer(case):
    """The engine plans once per step and attends layer after layer with that plan."""
    c, (q, cache, tables, lens, cu) = case(num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=F32)
    plan = plan_paged_attention(cache, tables, lens, cu, q.shape[0])
    other_layer = cache.clone()
    other_layer[~other_layer.isnan()] *= -0.5
    for layer in (cache, other_layer):
        assert_close(paged_attention_torch(q, layer, plan), paged_prefill_ref(q, layer, tables, lens, cu))
    with pytest.raises(InvalidArgumentError, match="plan was made for"):
        paged_attention_torch(q[:-1], cache, plan)


def test_bad_input_raises_the_kernels_errors(case, decode_case):
    c, (q, cache, tables, lens, cu) = case(seqs=[(13, 5), (6, 6)], num_heads=4, num_kv_heads=2, head_dim=64,
                                           block_size=8, dtype=F32)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    bad = [((q[:, :3], cache, tables, lens, cu), "multiple of"),
           ((q, cache, tables, torch.tensor([13, 0], **i32), cu), "must be >= 1"),
           ((q, cache, torch.where(tables == tables[0, 0], cache.shape[0], tables), lens, cu), r"must be in \[0, "),
           ((q, cache, tables, lens, torch.tensor([0, 12, 11], **i32)), "non-decreasing"),
           ((q, cache, tables, lens, cu.long()), "cu_query_lens has dtype"),
           ((q[..., :8], cache[..., :8], tables, lens, cu), "head_dim 8"),
           ((q, cache.as_strided(cache.shape, (cache.stride(0) // 2 + 8, *cache.stride()[1:])), tables, lens, cu),
            "overlap in memory")]
    for args, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            paged_prefill_torch(*args)
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        paged_prefill_torch(q, cache, tables, lens, cu, sliding_window=0)
    with pytest.raises(InvalidArgumentError, match="seq_lens has 2 entries but there are 3"):
        paged_attention_decode_torch(torch.cat([q[:2], q[:1]]), cache, tables, lens)
    key = torch.randn(3, 2, 64, device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="target of tokens"):
        reshape_and_cache_torch(key, key, cache, torch.tensor([5, 5, -1], device=DEVICE))
    with pytest.raises(InvalidArgumentError, match="key and value must both be"):
        reshape_and_cache_torch(key, key[:, :1], cache, torch.tensor([5, 6, -1], device=DEVICE))


@pytest.mark.parametrize("spread", [1.0, 300.0])
def test_split_k_partitions_merged_make_one_softmax(spread):
    """kvlab's split-K merge (the engine's when a learner's split-K kernel is merged by kvlab) over each sequence's
    used partitions only: the unused ones hold stale values (NaN, and maxima far above every score)."""
    gen = torch.Generator().manual_seed(0)
    heads, dim, part_len, parts = 3, 8, 4, [3, 1]
    partial_out = torch.full((2, 3, heads, dim), float("nan"))
    partial_max, partial_sum = torch.full((2, 3, heads), 1e30), torch.full((2, 3, heads), float("nan"))
    expected = []
    for s, used in enumerate(parts):
        n = used * part_len - 1  # the last partition one key short
        scores, values = torch.randn(heads, n, generator=gen) * spread, torch.randn(n, heads, dim, generator=gen)
        expected.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
        partial_out[s, :used], partial_max[s, :used], partial_sum[s, :used] = split_k_partitions(scores, values,
                                                                                                 part_len)
    merged = merge_split_k(partial_out, partial_max, partial_sum, torch.tensor(parts))
    torch.testing.assert_close(merged, torch.stack(expected), rtol=1e-5, atol=1e-5)
