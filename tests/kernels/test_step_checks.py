"""check_paged_step: the step's metadata checked once, as every launcher would check it; the unchecked
launchers it serves give the public launchers' results bit for bit."""

import pytest
import torch
from attention_cases import F32, build_case

from kvlab.device import DEVICE
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import paged_attention_decode, paged_prefill, reshape_and_cache
from kvlab.kernels.paged_attention_decode import paged_attention_decode_unchecked
from kvlab.kernels.paged_prefill import paged_prefill_unchecked
from kvlab.kernels.reshape_and_cache import reshape_and_cache_unchecked
from kvlab.kernels.step_checks import check_paged_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4


@pytest.fixture
def step(make_cache, random_block_tables):
    """(case, slot_mapping): a prefill of 3 sequences ((seq_len, q_len) = (9, 3), (5, 5), (6, 1)), the slots
    of each sequence's new tokens taken from its block table."""
    seq_lens, q_lens = [9, 5, 6], [3, 5, 1]
    case = build_case(make_cache, random_block_tables, seq_lens=seq_lens, q_lens=q_lens, num_heads=NUM_HEADS,
                      num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=F32)
    slots = [int(case.block_tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
             for s, (n, q) in enumerate(zip(seq_lens, q_lens)) for pos in range(n - q, n)]
    return case, torch.tensor(slots, dtype=torch.int64, device=DEVICE)


def _check(case, slots, *, prefill=True, max_seq_len=9, **changes):
    args = dict(kv_cache=case.kv_cache, num_heads=NUM_HEADS, slot_mapping=slots,
                block_tables=case.block_tables, seq_lens=case.seq_lens,
                cu_query_lens=case.cu_query_lens if prefill else None, max_seq_len=max_seq_len)
    args.update(changes)
    return check_paged_step(**args)


def test_a_good_step_passes_and_carries_the_longest_context_and_the_tile_map(step):
    case, slots = step
    checked = _check(case, slots)
    assert checked.max_seq_len == 9 and checked.tile_map is not None
    decode = _check(case, slots[:3], prefill=False)
    assert decode.tile_map is None


def test_an_fp8_cache_is_checked_with_its_queries_dtype(step):
    """An fp8 cache holds codes: the step's tile map follows the queries' dtype, which it must be told."""
    case, slots = step
    fp8 = torch.zeros(case.kv_cache.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="pass query_dtype"):
        _check(case, slots, kv_cache=fp8)
    checked = _check(case, slots, kv_cache=fp8, query_dtype=F32)
    assert torch.equal(checked.tile_map, _check(case, slots).tile_map)


@pytest.mark.parametrize("change, match", [
    (lambda c, s: dict(slot_mapping=torch.where(s == s[0], 10**6, s)), r"slot_mapping\[0\] = 1000000"),
    (lambda c, s: dict(slot_mapping=torch.cat([s[:1], s[:1], s[2:]])), "each slot may be written by at most one"),
    (lambda c, s: dict(block_tables=c.block_tables.index_fill(1, torch.tensor([0], device=DEVICE), 99)),
     r"block_tables\[0, 0\] = 99"),
    (lambda c, s: dict(seq_lens=c.seq_lens - 5), r"seq_lens\[1\] = 0; every sequence length must be >= 1"),
    (lambda c, s: dict(max_seq_len=8), r"seq_lens\[0\] = 9; every sequence length must be <= 8"),
    (lambda c, s: dict(cu_query_lens=c.cu_query_lens + 1), "cu_query_lens must start at 0"),
    (lambda c, s: dict(slot_mapping=s[:-1]), "cu_query_lens must start at 0 and end at the number of query rows"),
    (lambda c, s: dict(sliding_window=0), "sliding_window"),
    (lambda c, s: dict(max_seq_len=9.0), "max_seq_len must be an int"),
    (lambda c, s: dict(seq_lens=[9, 5, 6]), "seq_lens must be a torch.Tensor"),
], ids=["slot-out-of-range", "slot-twice", "block-out-of-range", "empty-sequence", "longer-than-max_seq_len",
        "cu_query_lens-start", "cu_query_lens-end", "window", "max_seq_len-float", "seq_lens-list"])
def test_refuses_what_the_launchers_refuse(step, change, match):
    case, slots = step
    with pytest.raises(InvalidArgumentError, match=match):
        _check(case, slots, **change(case, slots))


def test_decode_needs_one_token_per_sequence(step):
    case, slots = step
    with pytest.raises(InvalidArgumentError, match="seq_lens has 3 entries but there are 4 sequences"):
        _check(case, slots[:4], prefill=False)


def test_unchecked_launchers_match_the_public_ones(step):
    case, slots = step
    checked = _check(case, slots)
    key, value = (torch.randn(slots.shape[0], NUM_KV_HEADS, HEAD_DIM, device=DEVICE) for _ in range(2))
    public, unchecked = case.kv_cache.clone(), case.kv_cache.clone()
    reshape_and_cache(key, value, public, slots)
    reshape_and_cache_unchecked(key, value, unchecked, slots)
    assert torch.equal(public.nan_to_num(), unchecked.nan_to_num())

    tables, lens, cu = case.block_tables, case.seq_lens, case.cu_query_lens
    expected = paged_prefill(case.query, public, tables, lens, cu, sliding_window=4)
    actual = paged_prefill_unchecked(case.query, public, tables, lens, cu, checked.tile_map, None, 4)
    assert torch.equal(actual, expected)

    query = case.query[cu[1:].long() - 1]  # each sequence's newest token
    expected = paged_attention_decode(query, public, tables, lens, soft_cap=5.0)
    actual = paged_attention_decode_unchecked(query, public, tables, lens, checked.max_seq_len, soft_cap=5.0)
    assert torch.equal(actual, expected)
