"""KIVI caches (``kivi_int4``, ``kivi_int2``: kvlab.kernels.kv_quant, torch_paged_quant).

* Against KIVI's reference math: ``kivi_reference_keys`` / ``kivi_reference_values`` port the behaviour of the
  reference code's quantizers (jy-yuan/KIVI, ``quant/new_pack.py``: keys per channel over groups of G tokens,
  values per token over groups of G channels; min/max, scale = (max - min) / (2^b - 1), clamp, round); kvlab's
  stored codes and dequantized values agree with them on random K/V with outlier key channels.
* The paged step (``plan_kivi_step``, ``kivi_attention``) on NaN-poisoned pages: each query at position p
  attends over its own R-chunk in full precision and over KIVI-dequantized K/V before it, whether the
  context arrives in one prefill, in chunks or a token at a time.
"""

import pytest
import torch

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.kernels.torch_paged import plan_paged_attention
from kvlab.kernels.torch_paged_quant import ResidualWindow, kivi_attention, kivi_read_torch, plan_kivi_step
from kvlab.sizing.kv_dtypes import check_kivi_geometry, kivi_format, row_bytes

NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 2, 4, 32


def kivi_reference_keys(k, group, bits):
    """KIVI's key quantization, ``k [batch, heads, tokens, D]``: per channel over each group of ``group``
    tokens. Returns (codes, dequantized values, each group's scale), the first two like k."""
    b, h, t, d = k.shape
    data = k.reshape(b, h, t // group, group, d)
    mn, mx = data.amin(-2, keepdim=True), data.amax(-2, keepdim=True)
    scale = (mx - mn) / (2**bits - 1)
    codes = ((data - mn) / scale).clamp(0, 2**bits - 1).round()
    return codes.reshape(b, h, t, d), (codes * scale + mn).reshape(b, h, t, d), scale.expand_as(data).reshape(k.shape)


def kivi_reference_values(v, group, bits):
    """KIVI's value quantization, ``v [batch, heads, tokens, D]``: per token over each group of ``group``
    channels (the last dim)."""
    data = v.unflatten(-1, (-1, group))
    mn, mx = data.amin(-1, keepdim=True), data.amax(-1, keepdim=True)
    scale = (mx - mn) / (2**bits - 1)
    codes = ((data - mn) / scale).clamp(0, 2**bits - 1).round()
    return codes.flatten(-2), (codes * scale + mn).flatten(-2), scale.expand_as(data).flatten(-2)


def stored_codes(bytes_, bits, d):
    """The codes of one row's first ``d bits / 8`` bytes, element i at bits ``bits * (i mod 8 / bits)``."""
    per_byte = 8 // bits
    codes = torch.stack([(bytes_[..., :d * bits // 8] >> (bits * i)) & ((1 << bits) - 1)
                         for i in range(per_byte)], -1)
    return codes.flatten(-2).float()


def kv_sample(tokens, outlier_scale=20.0, seed=0):
    """K with outliers in a few channels (what makes KIVI quantize keys per channel), V plain; fp16-exact
    fp32 ``[tokens, H_kv, D]``, so a group's min is stored exactly."""
    gen = torch.Generator().manual_seed(seed)
    outliers = torch.zeros(NUM_KV_HEADS, HEAD_DIM, dtype=torch.bool)
    outliers[:, [3, 17]] = True
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen) * (1 + (outlier_scale - 1) * outliers)
    value = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return key.half().float(), value.half().float(), outliers


@pytest.mark.parametrize("bits, group", [(4, 32), (2, 32), (4, 16), (2, 64)])
def test_codes_and_values_match_kivis_reference_math(bits, group):
    tokens = 128
    key, value, outliers = kv_sample(tokens)
    q = KVQuantizer(kivi_format(bits, group), HEAD_DIM)
    k_bytes = row_bytes(q.codecs[0], HEAD_DIM)
    records = q.encode(key, value)
    assert records.shape == (tokens, NUM_KV_HEADS, sum(q.record_bytes))
    k_out, v_out = q.decode(records)
    for x, out, stored, reference in (
            (key, k_out, records[..., :k_bytes], kivi_reference_keys(key.transpose(0, 1)[None], group, bits)),
            (value, v_out, records[..., k_bytes:],
             kivi_reference_values(value.transpose(0, 1)[None], min(group, HEAD_DIM), bits))):
        ref_codes, ref_values, ref_scale = (t[0].transpose(0, 1) for t in reference)  # [tokens, H, D]
        codes = stored_codes(stored, bits, HEAD_DIM)
        # kvlab stores the scale in fp16 and codes with it; the reference keeps it in fp32: a code may differ
        # by one where (x - min) / scale is within fp16 rounding of a half, and elsewhere the values agree to
        # the scale's fp16 rounding.
        same = codes == ref_codes
        assert (codes - ref_codes).abs().max() <= 1 and same.float().mean() > 0.97
        assert torch.allclose(out[same], ref_values[same], rtol=0, atol=2e-3 * float(ref_scale.max()) * 2**bits)
        assert bool(((out - x).abs() <= ref_scale / 2 * 1.01 + 1e-6).all())
    # Why keys go per channel: quantized per token instead, the outlier channels' range would swamp the others.
    per_token = KVQuantizer(kivi_format(bits, group), HEAD_DIM).decode(q.encode(value, key))[1]
    normal = ~outliers.expand_as(key)
    assert (k_out - key).abs()[normal].mean() < 0.5 * (per_token - key).abs()[normal].mean()


def reference_attention(query, key, value, positions, quantizer, residual_length):
    """fp32 attention of the queries at ``positions`` of one sequence, each over its own R-chunk of ``key`` /
    ``value [L, H_kv, D]`` as given and every earlier position as KIVI quantizes it."""
    whole = len(key) // quantizer.kivi[1] * quantizer.kivi[1]  # whole key groups
    k_quant, v_quant = quantizer.decode(quantizer.encode(key[:whole], value[:whole]))
    rows = []
    for q, p in zip(query, positions):
        start = p // residual_length * residual_length
        k = torch.cat((k_quant[:start], key[start:p + 1])).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
        v = torch.cat((v_quant[:start], value[start:p + 1])).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
        weights = (torch.einsum("hd,lhd->hl", q, k) / HEAD_DIM**0.5).softmax(-1)
        rows.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(rows)


SCHEDULES = {  # per step, the new tokens of each sequence (lengths 45 and 70 in the end)
    "one prefill": [(45, 70)],
    "chunks": [(20, 33), (13, 30), (12, 7)],
    "token by token": [(13, 40)] + [(1, 1)] * 30 + [(2, 0)],
}


@pytest.mark.parametrize("bits, group, residual_length, block_size", [(4, 16, 16, 32), (2, 32, 32, 32),
                                                                       (4, 16, 32, 64)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_paged_steps_attend_over_the_window_and_kivi_quantized_chunks(bits, group, residual_length, block_size,
                                                                     schedule):
    quantizer = KVQuantizer(kivi_format(bits, group), HEAD_DIM, residual_length=residual_length)
    lengths = (45, 70)
    gen = torch.Generator().manual_seed(1)
    seqs = [kv_sample(n, seed=s)[:2] for s, n in enumerate(lengths)]
    queries = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen) for n in lengths]
    tables = torch.tensor([[5, 1, 0], [2, 6, 3]], dtype=torch.int32)  # blocks 4 and 7 never written
    cache = torch.full((8, 2, block_size, NUM_KV_HEADS, quantizer.storage_width), 0xFF, dtype=torch.uint8)
    window, done = ResidualWindow(), [0, 0]
    outputs = [[] for _ in lengths]
    for news in SCHEDULES[schedule]:
        running = [s for s, n in enumerate(news) if n]
        seq_lens = torch.tensor([done[s] + news[s] for s in running], dtype=torch.int32)
        cu = torch.tensor([0] + [news[s] for s in running]).cumsum(0).to(torch.int32)
        rows = [slice(done[s], done[s] + news[s]) for s in running]
        key, value, query = (torch.cat([x[s][r] for s, r in zip(running, rows)])
                             for x in ([k for k, _ in seqs], [v for _, v in seqs], queries))
        step_tables = tables[running][:, :-(-int(seq_lens.max()) // block_size)]
        plan = plan_paged_attention(cache, step_tables, seq_lens, cu, key.shape[0])
        decode = all(news[s] == 1 for s in running)
        step = plan_kivi_step(plan, step_tables, seq_lens, None if decode else cu, block_size, residual_length, group)
        out = kivi_attention(query, key, value, cache, step, quantizer, window)
        window.commit()  # the engine's runner commits once every layer has run
        for s, r, chunk in zip(running, rows, out.split([news[s] for s in running])):
            outputs[s].append(chunk)
            done[s] = r.stop
    for s, n in enumerate(lengths):
        expected = reference_attention(queries[s], *seqs[s], range(n), quantizer, residual_length)
        torch.testing.assert_close(torch.cat(outputs[s]), expected, rtol=1e-5, atol=1e-5)
    # Only the open chunks wait in the window: 45 and 70 tokens leave 45 % R and 70 % R of them.
    assert sorted(entry.shape[1] for entry in window.entries.values()) == sorted(n % residual_length
                                                                                for n in lengths)


@pytest.mark.parametrize("group, residual_length, block_size, message", [
    (32, None, 16, "block_size must be a multiple of 32, got 16"),
    (16, 24, 32, "must be a multiple of the key group 16 that divides block_size 32"),
    (16, 64, 32, "must be a multiple of the key group 16 that divides block_size 32"),
    (16, 8, 32, "must be a multiple of the key group 16"),
])
def test_a_window_that_does_not_fit_the_groups_and_blocks_is_refused(group, residual_length, block_size, message):
    with pytest.raises(InvalidArgumentError, match=message):
        check_kivi_geometry(group, residual_length, block_size)


def test_a_head_dim_that_does_not_split_into_the_rows_is_refused():
    with pytest.raises(InvalidArgumentError, match="2 x head_dim a multiple of 128; got head_dim 32"):
        KVQuantizer("kivi_int4_g128", 32)
    with pytest.raises(InvalidArgumentError, match="head_dim must be a multiple of 4"):
        KVQuantizer("kivi_int2", 30)


@pytest.mark.parametrize("name, head_dim", [("kivi_int4", 32), ("kivi_int2", 32), ("kivi_int4_g16", 32),
                                            ("kivi_int2_g64", 32), ("kivi_int4_g128", 64), ("kivi_int4_g16", 24),
                                            ("kivi_int2_g16", 48), ("kivi_int4", 80)])
def test_the_triton_seal_writes_the_torch_twins_bytes_and_nothing_else(name, head_dim):
    """``kivi_seal`` (interpreted on CPU) writes exactly the bytes of ``KVQuantizer.encode`` into the given slots
    of a poisoned cache, and leaves every other byte as it was. kivi_int4_g128 at head_dim 64 has K rows of 34
    bytes and V rows of 36, so records straddle the cache's K and V halves; head dims 24, 48 and 80 leave the
    last chunk of 32 channels part padding."""
    from kvlab.kernels.kivi_seal import kivi_seal

    q = KVQuantizer(name, head_dim)
    group = q.kivi[1]
    gen = torch.Generator().manual_seed(2)
    key = (torch.randn(2 * group, NUM_KV_HEADS, head_dim, generator=gen) * 4).half().float()
    key[:, :, 1] *= 30                                                     # an outlier channel
    value = torch.randn(2 * group, NUM_KV_HEADS, head_dim, generator=gen).half().float()
    block_size = 2 * group
    blocks = torch.tensor([3] * group + [1] * group)
    offsets = torch.cat((torch.arange(group) + group, torch.arange(group)))  # second half of 3, first of 1
    cache = torch.full((4, 2, block_size, NUM_KV_HEADS, q.storage_width), 0xFF, dtype=torch.uint8)
    expected = cache.clone()
    expected[blocks, :, offsets] = q.encode(key, value).unflatten(-1, (2, -1)).transpose(1, 2)
    key, value, cache, blocks, offsets = (t.to(DEVICE) for t in (key, value, cache, blocks, offsets))
    assert torch.equal(kivi_seal(key, value, cache, blocks, offsets, q).cpu(), expected)


def test_the_triton_seal_refuses_partial_groups_and_other_formats():
    from kvlab.kernels.kivi_seal import kivi_seal

    q = KVQuantizer("kivi_int4", HEAD_DIM)
    cache = torch.zeros(2, 2, 32, NUM_KV_HEADS, q.storage_width, dtype=torch.uint8)
    x = torch.zeros(20, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(InvalidArgumentError, match="N a multiple of 32"):
        kivi_seal(x, x, cache, torch.zeros(20, dtype=torch.int64), torch.arange(20), q)
    with pytest.raises(InvalidArgumentError, match="writes a KIVI cache"):
        kivi_seal(x, x, cache, torch.zeros(20, dtype=torch.int64), torch.arange(20), KVQuantizer("fp8", HEAD_DIM))


def kivi_read_case(name, head_dim, num_heads, residual_length, block_size, seq_shapes, dtype=torch.float32,
                   seed=3):
    """A KIVI cache holding the sealed chunks of sequences of (length, new tokens) ``seq_shapes``, each in
    random blocks of a pool whose every other byte is 0xFF (an fp16 NaN as a scale); ``open_kv`` with each
    sequence's open chunk and NaN past it, block-table padding out of range, all on ``DEVICE``. Returns the
    launcher's arguments and the torch twin's step."""
    quantizer = KVQuantizer(name, head_dim, residual_length=residual_length)
    gen = torch.Generator().manual_seed(seed)
    lengths = [n for n, _ in seq_shapes]
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3                                       # three pages nobody uses
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(widths) + 1), 10**6, dtype=torch.int32)  # padding is never read
    cache = torch.full((num_blocks, 2, block_size, NUM_KV_HEADS, quantizer.storage_width), 0xFF, dtype=torch.uint8)
    open_starts = [(n - q) // residual_length * residual_length for n, q in seq_shapes]
    open_kv = torch.full((2, len(lengths), max(n - o for n, o in zip(lengths, open_starts)) + 5, NUM_KV_HEADS,
                          head_dim), float("nan"), dtype=dtype)
    for s, (n, width) in enumerate(zip(lengths, widths)):
        tables[s, :width] = torch.tensor([order.pop() for _ in range(width)])
        key = (torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen) * 3).to(dtype).float()
        key[:, :, 1] *= 10                                             # an outlier channel
        value = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).float()
        sealed = n // residual_length * residual_length
        positions = torch.arange(sealed)
        if sealed:
            records = quantizer.encode(key[:sealed], value[:sealed]).unflatten(-1, (2, -1)).transpose(1, 2)
            cache[tables[s, positions // block_size].long(), :, positions % block_size] = records
        open_kv[:, s, :n - open_starts[s]] = torch.stack((key, value))[:, open_starts[s]:].to(dtype)
    q_lens = [q for _, q in seq_shapes]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query, cache, tables, seq_lens, cu, open_kv = (t.to(DEVICE) for t in (query, cache, tables, seq_lens, cu, open_kv))
    decode = all(q == 1 for q in q_lens)
    plan = plan_paged_attention(cache, tables, seq_lens, cu, query.shape[0])
    step = plan_kivi_step(plan, tables, seq_lens, None if decode else cu, block_size, residual_length,
                          quantizer.kivi[1])
    return (query, cache, tables, seq_lens, None if decode else cu, open_kv, quantizer), step


READ_CASES = {  # name, head_dim, query heads (2 KV heads), R, block_size, (length, new tokens) per sequence
    "decode int4": ("kivi_int4_g16", 32, 4, 16, 32, [(45, 1), (70, 1), (16, 1), (3, 1)]),
    "decode int2, head_dim 24, 3 heads a KV head": ("kivi_int2_g16", 24, 6, 32, 32, [(77, 1), (33, 1), (64, 1)]),
    "prefill int4, chunks over cached prefixes": ("kivi_int4_g16", 32, 4, 16, 32, [(70, 25), (41, 41), (50, 3)]),
    "prefill int2 g32, head_dim 48, one head a KV head": ("kivi_int2", 48, 2, 32, 64, [(99, 40), (20, 20)]),
    "prefill int4 g64, records straddle the halves": ("kivi_int4_g64", 32, 4, 64, 64, [(130, 70), (65, 2)]),
}


@pytest.mark.parametrize("case", READ_CASES)
def test_the_triton_read_matches_the_torch_twin_on_poisoned_memory(case):
    """``kivi_paged_attention`` (interpreted on CPU) gives ``kivi_read_torch``'s output, decode and prefill,
    while every page, slot and buffer entry the step must not read holds NaN (any such read would show)."""
    from kvlab.kernels.kivi_paged_attention import kivi_paged_attention

    args, step = kivi_read_case(*READ_CASES[case])
    query, cache, _, _, _, open_kv, quantizer = args
    expected = kivi_read_torch(query, cache, step, quantizer, open_kv)
    out = kivi_paged_attention(*args)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_triton_read_refuses_what_it_cannot_read():
    from kvlab.kernels.kivi_paged_attention import kivi_paged_attention

    (query, cache, tables, seq_lens, cu, open_kv, quantizer), _ = kivi_read_case(*READ_CASES["decode int4"])
    with pytest.raises(InvalidArgumentError, match="a KVQuantizer of a KIVI format with its residual_length"):
        kivi_paged_attention(query, cache, tables, seq_lens, cu, open_kv, KVQuantizer("kivi_int4_g16", HEAD_DIM))
    with pytest.raises(InvalidArgumentError, match=r"open_kv must be \[2, 4, at least 16, 2, 32\]"):
        kivi_paged_attention(query, cache, tables, seq_lens, cu, open_kv[:, :, :15], quantizer)
    with pytest.raises(InvalidArgumentError, match="one query per sequence: 4 rows, got 3"):
        kivi_paged_attention(query[:3], cache, tables, seq_lens, cu, open_kv, quantizer)
    with pytest.raises(InvalidArgumentError, match=r"is uint8 \[blocks, 2, a multiple of 16, kv heads, 24\]"):
        kivi_paged_attention(query, cache[..., :17], tables, seq_lens, cu, open_kv, quantizer)
    if not ON_GPU:
        with pytest.raises(InvalidArgumentError, match="bfloat16, which the Triton interpreter .* computes wrongly"):
            kivi_paged_attention(query.bfloat16(), cache, tables, seq_lens, cu, open_kv, quantizer)
