"""paged_prefill against kvlab.kernels.reference on NaN-poisoned caches: cached prefixes of any length, sequences of
different lengths in one launch, GQA ratios 1/3/4/8, every supported block size (1 to 128), head dims from 16
to 256 incl. padded ones (17, 48, 80, 200, 255), sliding window, soft cap, strided inputs; agreement with full
prefill and with decode; bad input raises."""

import pytest
import torch
from attention_cases import CONFIGS, F32, GEOMETRIES, assert_close, build_case, strided_block_tables

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.paged_attention_decode import paged_attention_decode
from kvlab.kernels.paged_prefill import paged_prefill, query_tile_map
from kvlab.kernels.reference import paged_prefill_ref

# (seq_len, q_len): a prefix hit, a 1-token sequence, a full prefill (no prefix), a sequence with no new
# tokens, a decode-like single new token, a long prefix with several query tiles.
SEQS = [(37, 10), (1, 1), (45, 45), (29, 0), (70, 1), (53, 20)]


@pytest.fixture
def case(make_cache, random_block_tables):
    def build(seqs=SEQS, **kwargs):
        seq_lens, q_lens = (list(x) for x in zip(*seqs))
        c = build_case(make_cache, random_block_tables, seq_lens=seq_lens, q_lens=q_lens, **kwargs)
        return c, (*c.args(), c.cu_query_lens)
    return build


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, dtype, layout", CONFIGS)
def test_matches_reference(case, num_heads, num_kv_heads, head_dim, block_size, dtype, layout):
    _, args = case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                   dtype=dtype, layout=layout, strided_query=layout != "contiguous")
    assert_close(paged_prefill(*args), paged_prefill_ref(*args))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, dtype, layout", GEOMETRIES)
def test_every_block_size_and_head_dim_range(case, num_heads, num_kv_heads, head_dim, block_size, dtype, layout):
    # Fewer sequences than SEQS (the interpreter's cost grows with query tiles), still: a prefix hit over
    # several query tiles, a 1-token sequence, a full prefill and a sequence with no new tokens.
    _, args = case(seqs=[(53, 20), (1, 1), (30, 30), (9, 0)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=block_size, dtype=dtype, layout=layout, strided_query=True)
    assert_close(paged_prefill(*args), paged_prefill_ref(*args))


@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_bf16_supported()), reason="bf16 needs a GPU that supports it")
def test_bf16_on_gpu(case):
    _, args = case(num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert_close(paged_prefill(*args), paged_prefill_ref(*args))


@pytest.mark.parametrize("sliding_window, soft_cap, scale", [
    (1, None, None), (6, None, None), (21, None, None), (500, None, None),
    (None, 2.0, None), (None, 30.0, 0.5), (9, 1.5, 0.3)])
def test_window_soft_cap_and_scale(case, sliding_window, soft_cap, scale):
    _, args = case(num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    assert_close(paged_prefill(*args, **options), paged_prefill_ref(*args, **options))


def test_prefix_hit_equals_full_prefill(case):
    # The point of the kernel: computing only the new tokens over the cached prefix gives exactly the rows a
    # full prefill over every token would give for them.
    seqs = [(40, 40), (27, 27)]
    c, args = case(seqs=seqs, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=F32)
    full = paged_prefill(*args)
    new_tokens = [9, 1]
    rows = torch.cat([torch.arange(c.cu_query_lens[s + 1] - n, c.cu_query_lens[s + 1])
                      for s, n in enumerate(new_tokens)])
    cu_new = torch.tensor([0] + new_tokens, device=DEVICE).cumsum(0).to(torch.int32)
    hit = paged_prefill(c.query[rows.to(DEVICE)], c.kv_cache, c.block_tables, c.seq_lens, cu_new)
    torch.testing.assert_close(hit, full[rows.to(DEVICE)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_one_new_token_equals_decode(case, sliding_window):
    c, args = case(seqs=[(37, 1), (1, 1), (70, 1)], num_heads=8, num_kv_heads=2, head_dim=80, block_size=8,
                   dtype=F32)
    decode = paged_attention_decode(*c.args(), sliding_window=sliding_window, split_k=2)
    torch.testing.assert_close(paged_prefill(*args, sliding_window=sliding_window), decode, atol=1e-5, rtol=1e-5)


def test_strided_block_tables(case):
    c, _ = case(seqs=[(29, 12), (3, 2)], num_heads=2, num_kv_heads=1, head_dim=80, block_size=8, dtype=F32)
    args = (c.query, c.kv_cache, strided_block_tables(c.block_tables), c.seq_lens, c.cu_query_lens)
    assert_close(paged_prefill(*args), paged_prefill_ref(*c.args(), c.cu_query_lens))


def test_no_new_tokens_at_all(case):
    _, args = case(seqs=[(12, 0), (5, 0)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    assert paged_prefill(*args).shape == (0, 2, 64)


def test_query_tile_map_covers_every_new_token_once():
    seq_lens = torch.tensor([50, 7, 9, 30], dtype=torch.int32)
    cu = torch.tensor([0, 20, 27, 27, 31], dtype=torch.int32)  # q_lens 20, 7, 0, 4
    tiles = query_tile_map(cu, seq_lens, block_q=8)
    covered = sorted((seq, t) for seq, start in tiles.tolist()
                     for t in range(start, min(start + 8, int(cu[seq + 1] - cu[seq]))))
    assert covered == sorted((s, t) for s in range(4) for t in range(int(cu[s + 1] - cu[s])))
    prefix_ends = [int(seq_lens[s] - (cu[s + 1] - cu[s])) + start for s, start in tiles.tolist()]
    assert prefix_ends == sorted(prefix_ends, reverse=True)  # heaviest tiles first


# ---- launcher errors ----------------------------------------------------------------------------------------

def _bad(args, name):
    q, cache, tables, lens, cu = args  # 2 sequences: (13, 5), (6, 6)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    changes = {
        "query ndim": (q[0], cache, tables, lens, cu),
        "query dtype": (q.half(), cache, tables, lens, cu),
        "query device": (q.to("meta"), cache, tables, lens, cu),
        "heads not a multiple": (q[:, :3], cache, tables, lens, cu),
        "block id too big": (q, cache, torch.where(tables == tables[0, 0], 10**6, tables), lens, cu),
        "seq_len 0": (q, cache, tables, torch.tensor([13, 0], **i32), cu),
        "seq_len over capacity": (q, cache, tables, lens + 8 * tables.shape[1], cu),
        "cu dtype": (q, cache, tables, lens, cu.long()),
        "cu length": (q, cache, tables, lens, cu[:2]),
        "cu not from 0": (q, cache, tables, lens, cu + 1),
        "cu end not query rows": (q[:-1], cache, tables, lens, cu),
        "cu decreasing": (q, cache, tables, lens, torch.tensor([0, 12, 11], **i32)),
        "q_len over seq_len": (q, cache, tables, torch.tensor([4, 6], **i32), cu),
        "seq_lens not a tensor": (q, cache, tables, [13, 6], cu),
    }
    return changes[name]


@pytest.mark.parametrize("name", ["query ndim", "query dtype", "query device", "heads not a multiple",
                                  "block id too big", "seq_len 0", "seq_len over capacity", "cu dtype",
                                  "cu length", "cu not from 0", "cu end not query rows", "cu decreasing",
                                  "q_len over seq_len", "seq_lens not a tensor"])
def test_bad_input_raises(case, name):
    _, args = case(seqs=[(13, 5), (6, 6)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    with pytest.raises(InvalidArgumentError):
        paged_prefill(*_bad(args, name))


@pytest.mark.parametrize("options, match", [({"sliding_window": -2}, "sliding_window"),
                                            ({"soft_cap": 0.0}, "soft_cap"), ({"scale": "big"}, "scale")])
def test_bad_options_raise(case, options, match):
    _, args = case(seqs=[(13, 5)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    with pytest.raises(InvalidArgumentError, match=match):
        paged_prefill(*args, **options)


def test_meta_tensors_raise_instead_of_a_torch_traceback(case):
    _, args = case(seqs=[(13, 5), (6, 6)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    with pytest.raises(InvalidArgumentError, match="kv_cache is a meta tensor .* real memory"):
        paged_prefill(*(t.to("meta") for t in args))


def test_a_cache_with_overlapping_heads_raises(case):
    _, (q, cache, tables, lens, cu) = case(seqs=[(13, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                                           dtype=F32)
    overlapping = cache.as_strided(cache.shape, (*cache.stride()[:3], 32, 1))  # head 1 starts mid-way into head 0
    with pytest.raises(InvalidArgumentError, match="gives its heads a stride of 32, inside the 64 elements"):
        paged_prefill(q, overlapping, tables, lens, cu)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 limitation only applies on CPU")
def test_bf16_is_rejected_on_cpu(case):
    _, (q, cache, tables, lens, cu) = case(seqs=[(5, 2)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                           dtype=F32)
    with pytest.raises(InvalidArgumentError, match="bfloat16"):
        paged_prefill(q.bfloat16(), cache.bfloat16(), tables, lens, cu)
