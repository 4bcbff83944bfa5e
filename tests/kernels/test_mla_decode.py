"""mla_decode (the Triton MLA decode kernel) against its torch twin (torch_paged.mla_decode_torch) and the
reference (reference.mla_decode_ref) on NaN-poisoned latent caches: unused blocks, unused table entries and the
padding of padded rows are NaN (or far out-of-range ids), so a read outside the sequence shows in the output.
Odd latent sizes (kv_lora_rank 17 and 20 on tiles of 32, rotary parts 1 and 6 on 16), head counts around the
16-head tile, every block size from 1 to 128; bad input raises."""

import pytest
import torch
from attention_cases import F16, F32, assert_close

from kvlab.device import DEVICE
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import allocate_latent_cache, mla_decode, mla_decode_torch
from kvlab.kernels.reference import mla_decode_ref

SEQ_LENS = [37, 1, 20, 16]  # a 1-token sequence, block multiples and not; 37 crosses several 16-token tiles

# (kv_lora_rank, rope_dim, num_heads, block_size, dtype, padded rows)
GEOMETRIES = [
    pytest.param(32, 16, 4, 8, F32, False, id="r32+16-h4-b8-fp32"),
    pytest.param(20, 6, 5, 4, F32, True, id="r20+6-h5-b4-fp32-padded"),
    pytest.param(17, 1, 17, 1, F32, False, id="r17+1-h17-b1-fp32"),
    pytest.param(64, 16, 16, 16, F16, True, id="r64+16-h16-b16-fp16-padded"),
    pytest.param(16, 8, 3, 128, F16, False, id="r16+8-h3-b128-fp16"),
    pytest.param(48, 32, 2, 2, F32, False, id="r48+32-h2-b2-fp32"),
]


def latent_case(random_block_tables, seq_lens, kv_lora_rank, rope_dim, num_heads, block_size, dtype, padded,
                spare_blocks=2):
    """(query, latent_cache, block_tables, seq_lens): random rows in the sequences' slots, NaN everywhere
    else (``padded``: rows are 3 elements wider in memory, NaN too); the query sliced from a wider buffer."""
    latent_dim = kv_lora_rank + rope_dim
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare_blocks
    storage = torch.full((num_blocks, block_size, latent_dim + 3 * padded), float("nan"), dtype=dtype,
                         device=DEVICE)
    cache = storage[..., :latent_dim]
    tables, lens = random_block_tables(seq_lens, block_size, num_blocks)
    for s, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=DEVICE)
        cache[tables[s].long()[positions // block_size], positions % block_size] = (
            torch.randn(seq_len, latent_dim, device=DEVICE).to(dtype))
    query = torch.randn(len(seq_lens), num_heads + 1, latent_dim + 2, device=DEVICE).to(dtype)[:, 1:, :latent_dim]
    return query, cache, tables, lens


@pytest.mark.parametrize("kv_lora_rank, rope_dim, num_heads, block_size, dtype, padded", GEOMETRIES)
def test_kernel_matches_its_torch_twin_and_the_reference(random_block_tables, kv_lora_rank, rope_dim, num_heads,
                                                         block_size, dtype, padded):
    query, cache, tables, lens = latent_case(random_block_tables, SEQ_LENS, kv_lora_rank, rope_dim, num_heads,
                                             block_size, dtype, padded)
    scale = 0.7 / (kv_lora_rank ** 0.5)  # the model's scale, unrelated to the latent width
    before = cache.clone()
    out = mla_decode(query, cache, tables, lens, kv_lora_rank, scale)
    twin = mla_decode_torch(query, cache, tables, lens, kv_lora_rank, scale)
    assert out.shape == twin.shape == (len(SEQ_LENS), num_heads, kv_lora_rank)
    assert out.dtype == twin.dtype == dtype and out.is_contiguous()
    assert_close(out, twin)
    assert_close(twin, mla_decode_ref(query, cache, tables, lens, kv_lora_rank, scale))
    assert torch.equal(cache.isnan(), before.isnan()) and torch.equal(cache.nan_to_num(), before.nan_to_num())


def test_the_rotary_part_counts_in_the_scores_but_is_not_a_value(random_block_tables):
    """Zeroing the rows' rotary parts changes the output (they are keys), and the output has kv_lora_rank
    features, not the whole row."""
    query, cache, tables, lens = latent_case(random_block_tables, [30, 9], 32, 16, 4, 8, F32, False)
    out = mla_decode(query, cache, tables, lens, 32, 0.2)
    no_rope = cache.clone()
    no_rope[..., 32:] = torch.where(no_rope[..., 32:].isnan(), no_rope[..., 32:], 0.0)
    changed = mla_decode(query, no_rope, tables, lens, 32, 0.2)
    assert out.shape[-1] == 32 and not torch.allclose(out, changed)
    assert_close(changed, mla_decode_ref(query, no_rope, tables, lens, 32, 0.2))


def test_empty_batch(random_block_tables):
    _, cache, _, _ = latent_case(random_block_tables, [5], 32, 16, 4, 8, F32, False)
    query = torch.empty(0, 4, 48, device=DEVICE)
    tables, lens = (torch.empty(0, 2, dtype=torch.int32, device=DEVICE), torch.empty(0, dtype=torch.int32,
                                                                                      device=DEVICE))
    assert mla_decode(query, cache, tables, lens, 32, 0.2).shape == (0, 4, 32)


def test_allocate_latent_cache():
    caches = allocate_latent_cache(3, 48, num_blocks=5, block_size=8, dtype=F16, device=DEVICE)
    assert [tuple(c.shape) for c in caches] == [(5, 8, 48)] * 3 and caches[0].dtype == F16
    with pytest.raises(InvalidArgumentError, match="latent_dim must be an int >= 1"):
        allocate_latent_cache(3, 0, num_blocks=5, block_size=8, dtype=F16, device=DEVICE)


def _bad(query, cache, tables, lens, name):
    """The launcher's arguments with one thing wrong."""
    args = dict(query=query, latent_cache=cache, block_tables=tables, seq_lens=lens, kv_lora_rank=32, scale=0.2)
    if name == "rank over the row":
        args["kv_lora_rank"] = 48
    elif name == "rank too small":
        args.update(kv_lora_rank=8)
    elif name == "query width":
        args["query"] = query[..., :40]
    elif name == "query dtype":
        args["query"] = query.half()
    elif name == "block id out of range":
        tables = tables.clone()
        tables[0, 0] = cache.shape[0]
        args["block_tables"] = tables
    elif name == "seq_len zero":
        args["seq_lens"] = torch.zeros_like(lens)
    elif name == "scale zero":
        args["scale"] = 0.0
    elif name == "block size 3":
        args["latent_cache"] = torch.zeros(4, 3, 48, device=DEVICE)
    elif name == "a K/V cache":
        args["latent_cache"] = torch.zeros(4, 2, 8, 1, 48, device=DEVICE)
    return args


@pytest.mark.parametrize("name, match", [
    ("rank over the row", "rotary part of 0"), ("rank too small", "kv_lora_rank must be an int, any int from 16"),
    ("query width", "query has 40 features per head but the latent cache's rows have 48"),
    ("query dtype", "query has dtype float16; allowed: float32"),
    ("block id out of range", r"block_tables\[0, 0\] = \d+ is used by sequence 0 but not a block id"),
    ("seq_len zero", "every sequence length must be >= 1"), ("scale zero", "scale must be a finite number > 0"),
    ("block size 3", "block_size 3; supported: 1, 2, 4"), ("a K/V cache", "latent_cache must be 3-D")])
def test_bad_input_raises_for_the_kernel_and_its_twin(random_block_tables, name, match):
    query, cache, tables, lens = latent_case(random_block_tables, [13, 6], 32, 16, 4, 8, F32, False)
    for launcher in (mla_decode, mla_decode_torch):
        with pytest.raises(InvalidArgumentError, match=match):
            launcher(**_bad(query, cache, tables, lens, name))
