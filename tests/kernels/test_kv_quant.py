"""Quantized KV caches (kvlab.kernels.kv_quant, torch_paged_quant): every format's round trip stays within its
codec's error bound, and attention on a quantized cache equals the reference attention (kvlab.kernels.reference)
on the same K/V decoded, on caches whose unused bytes are poisoned (0xFF: NaN in fp8 and fp16, NaN scales in
int4 rows), so a read of an unwritten slot would show. The Triton decode and prefill kernels read fp8 caches as
the torch twin does (in the interpreter too); the fp8 write runs compiled only."""

import importlib
import json
import re

import pytest
import torch

from kvlab.device import DEVICE, ON_GPU
from kvlab.engine.config import load_model_config
from kvlab.engine.kv_calibration import KVRanges, make_quantizers
from kvlab.errors import InvalidArgumentError, UnsupportedError
from kvlab.kernels import paged_attention_decode, paged_prefill, reshape_and_cache
from kvlab.kernels.kv_quant import FP8_CODECS, INT4_LEVELS, KVQuantizer
from kvlab.kernels.reference import paged_attention_decode_ref, paged_prefill_ref, reshape_and_cache_ref
from kvlab.kernels.torch_paged import plan_paged_attention
from kvlab.kernels.torch_paged_quant import (paged_attention_decode_torch_quantized,
                                             paged_attention_torch_quantized, reshape_and_cache_quantized)
from kvlab.sizing.kv_dtypes import ENGINE_KV_CACHE_DTYPES, kivi_settings, row_bytes, value_group

#: The formats whose rows encode alone (KIVI encodes whole key groups: tests/kernels/test_kivi.py).
FORMATS = [name for name in ENGINE_KV_CACHE_DTYPES if name != "auto" and kivi_settings(name) is None]
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 32, 8, 12


def kv_sample(tokens=40):
    """K with a few outlier channels (as real keys have), V plain; ``[tokens, H_kv, D]`` fp32."""
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM) * (1 + 9 * (torch.rand(NUM_KV_HEADS, HEAD_DIM) < 0.1))
    return key, torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM) * 2


def calibrated(name, key, value, granularity="head"):
    """A quantizer with scales from ``key`` / ``value``'s own ranges, as kvlab.engine.kv_calibration sets them."""
    q = KVQuantizer(name, HEAD_DIM)
    k_codec, v_codec = q.codecs
    for codec, x, attr in ((k_codec, key, "k_scale"), (v_codec, value, "v_scale")):
        if codec in FP8_CODECS:
            absmax = x.abs().amax((0, 2))
            if granularity == "tensor":
                absmax = absmax.max().expand(NUM_KV_HEADS).contiguous()
            setattr(q, attr, absmax / torch.finfo(FP8_CODECS[codec]).max)
    if k_codec == "int4_channel":
        q.k_zero, q.k_scale = key.amin(0), (key.amax(0) - key.amin(0)) / INT4_LEVELS
    q.check(NUM_KV_HEADS)
    return q


def codec_bound(codec, x, scale):
    """The largest error ``codec`` may make on each element of x ``[T, H, D]`` (round to nearest)."""
    if codec == "float16":
        return x.abs() * 2**-11
    if codec in ("fp8_e4m3", "fp8_e5m2"):  # half a unit in the last place, or of the subnormal spacing
        mantissa, subnormal = (3, 2**-9) if codec == "fp8_e4m3" else (2, 2**-16)
        return x.abs() * 2**-(mantissa + 1) + scale[:, None] * subnormal / 2
    if codec == "int4_channel":
        return scale / 2 * (1 + 1e-5) + 1e-6
    groups = x.unflatten(-1, (-1, value_group(HEAD_DIM)))  # int4_token: half a step, plus fp16 scale and zero
    span, largest = groups.amax(-1) - groups.amin(-1), groups.abs().amax(-1)
    bound = span / (2 * INT4_LEVELS) * (1 + 2**-9) + largest * 2**-10
    return bound[..., None].expand_as(groups).flatten(-2)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_round_trip_error_is_within_each_codecs_bound(name, granularity):
    key, value = kv_sample()
    q = calibrated(name, key, value, granularity)
    records = q.encode(key, value)
    assert records.dtype == torch.uint8 and records.shape == (40, NUM_KV_HEADS, sum(q.record_bytes))
    assert list(q.record_bytes) == [row_bytes(codec, HEAD_DIM) for codec in q.codecs]
    k_back, v_back = q.decode(records)
    for codec, x, back, scale in ((q.codecs[0], key, k_back, q.k_scale), (q.codecs[1], value, v_back, q.v_scale)):
        error = (back - x).abs()
        assert bool((error <= codec_bound(codec, x, scale)).all()), f"{codec}: worst {error.max():.3g}"
        assert bool((error > 0).any())  # it is a lossy format: the test would see no error if nothing was encoded


def test_fp8_values_past_the_scale_saturate_instead_of_becoming_nan():
    q = KVQuantizer("fp8_e4m3", HEAD_DIM, k_scale=torch.ones(NUM_KV_HEADS), v_scale=torch.ones(NUM_KV_HEADS))
    big = torch.full((1, NUM_KV_HEADS, HEAD_DIM), 1e6)
    k_back, v_back = q.decode(q.encode(big, -big))
    assert bool((k_back == 448).all() and (v_back == -448).all())


def poisoned_cache(q: KVQuantizer):
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, q.storage_width)
    return torch.full(shape, 0xFF, dtype=torch.uint8).view(q.storage_dtype)


def decoded_twin(q, key, value, slot_mapping):
    """A NaN-poisoned fp32 cache holding what the quantized cache decodes to, in the same slots."""
    cache = torch.full((NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    return reshape_and_cache_ref(*q.decode(q.encode(key, value)), cache, slot_mapping)


def paged_batch(seq_lens):
    """Block tables over distinct random blocks and the slot of every token of every sequence."""
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    blocks = torch.randperm(NUM_BLOCKS)[:sum(needed)].split(needed)
    width = max(needed)
    tables = torch.stack([torch.cat([b, torch.zeros(width - len(b), dtype=torch.int64)]) for b in blocks]).int()
    slots = torch.cat([b.repeat_interleave(BLOCK_SIZE)[:n] * BLOCK_SIZE + torch.arange(n) % BLOCK_SIZE
                       for b, n in zip(blocks, seq_lens)])
    return tables, torch.tensor(seq_lens, dtype=torch.int32), slots


@pytest.mark.parametrize("name", FORMATS)
def test_attention_on_a_quantized_cache_is_the_reference_on_the_decoded_kv(name):
    seq_lens = [13, 5, 20]
    tables, lens, slots = paged_batch(seq_lens)
    key, value = kv_sample(len(slots))
    q = calibrated(name, key, value)
    cache = reshape_and_cache_quantized(key, value, poisoned_cache(q), slots, q)
    twin = decoded_twin(q, key, value, slots)

    query = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM)
    out = paged_attention_decode_torch_quantized(query, cache, tables, lens, q)
    assert bool(out.isfinite().all())
    torch.testing.assert_close(out, paged_attention_decode_ref(query, twin, tables, lens), atol=1e-5, rtol=1e-5)

    q_lens = [4, 5, 1]  # prefill rows: each sequence's newest tokens over its whole context
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    queries = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM)
    plan = plan_paged_attention(cache, tables, lens, cu, sum(q_lens))
    out = paged_attention_torch_quantized(queries, cache, plan, q)
    torch.testing.assert_close(out, paged_prefill_ref(queries, twin, tables, lens, cu), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_a_write_touches_only_its_slots(name):
    key, value = kv_sample(3)
    q = calibrated(name, key, value)
    cache = reshape_and_cache_quantized(key, value, poisoned_cache(q), torch.tensor([5, -1, 17]), q)
    touched = (cache.view(torch.uint8) != 0xFF).flatten(1).any(1).nonzero().flatten().tolist()
    assert touched == [0, 2]  # the blocks of slots 5 and 17; the skipped token writes nothing


def test_bad_scales_and_a_mismatched_cache_are_refused():
    key, value = kv_sample(2)
    q = calibrated("fp8_e4m3", key, value)
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        bad = KVQuantizer("fp8_e4m3", HEAD_DIM, k_scale=torch.zeros(NUM_KV_HEADS), v_scale=q.v_scale)
        reshape_and_cache_quantized(key, value, poisoned_cache(q), torch.tensor([0, 1]), bad)
    other = calibrated("int4_calibrated_channel", key, value)
    with pytest.raises(InvalidArgumentError, match="int4_calibrated_channel cache"):
        reshape_and_cache_quantized(key, value, poisoned_cache(q), torch.tensor([0, 1]), other)


@pytest.mark.parametrize("args, message", [
    (("int7", HEAD_DIM), "unknown KV cache dtype 'int7'; known: float32, fp32,"),  # a KeyError later, before
    ((None, HEAD_DIM), "unknown KV cache dtype None"),
    (("fp8", 0), "head_dim must be an int >= 1, got 0"),
    (("fp8", 32.0), "head_dim must be an int >= 1, got 32.0"),
    (("int4_calibrated_channel", 15),
     "the int4_calibrated_channel cache packs two 4-bit codes a byte, so head_dim must be even, got 15"),
])
def test_a_quantizer_of_an_unknown_format_or_a_bad_head_dim_is_refused(args, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        KVQuantizer(*args)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """A config.json of NUM_KV_HEADS kv heads of HEAD_DIM and two layers (no weights: make_quantizers reads none)."""
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS,
        num_hidden_layers=2, intermediate_size=64, vocab_size=100, max_position_embeddings=64)))
    return load_model_config(path)


def observed(layers: int) -> list:
    ranges = [KVRanges() for _ in range(layers)]
    for layer_ranges in ranges:
        layer_ranges.observe(*kv_sample())
    return ranges


@pytest.mark.parametrize("change, message", [
    (dict(granularity="channel"), "granularity must be one of 'tensor', 'head' (fp8 scales per layer or per KV "
                                  "head), got 'channel'"),  # silently per-head scales before
    (dict(granularity=None), "granularity must be one of 'tensor', 'head'"),
    (dict(kv_cache_dtype="bogus"), "kv_cache_dtype must be one of 'float32', 'fp32',"),  # KeyError before
    (dict(kv_cache_dtype="auto"), "(\"auto\" needs no quantizers), got 'auto'"),
    (dict(ranges=[]), "ranges must be None (unit scales) or a list of 2 KVRanges, one per layer (calibrate's "
                      "result), got a list of 0"),  # IndexError before
    (dict(ranges=observed(1)), "a list of 2 KVRanges, one per layer (calibrate's result), got a list of 1: KVRanges"),
    (dict(ranges=[1, 2]), "got a list of 2: int, int"),
    (dict(config=None), "config must be a kvlab.engine.config.ModelConfig, got NoneType"),
    (dict(ranges=None, device="bogus"), "device must be None (torch's default), a torch.device or its name"),
])
def test_make_quantizers_refuses_each_bad_argument(model_config, change, message):
    args = dict(kv_cache_dtype="fp8", config=model_config, ranges=observed(2), granularity="head", device="cpu")
    assert len(make_quantizers(**args)) == 2
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        make_quantizers(**(args | change))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16])
def test_the_triton_decode_kernel_reads_fp8_caches_as_the_torch_twin(name, query_dtype):
    """The interpreter (TRITON_INTERPRET on CPU) converts fp8 -> float exactly, so the kernel's read runs here."""
    seq_lens = [13, 5, 20]
    tables, lens, slots = paged_batch(seq_lens)
    key, value = kv_sample(len(slots))
    q = calibrated(name, key, value)
    cache = reshape_and_cache_quantized(key, value, poisoned_cache(q), slots, q)
    query = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM).to(query_dtype)
    out = paged_attention_decode(query.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE),
                                 k_scale=q.k_scale.to(DEVICE), v_scale=q.v_scale.to(DEVICE))
    expected = paged_attention_decode_torch_quantized(query, cache, tables, lens, q)
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2  # fp16: the kernel rounds K and V to the query dtype
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("query_dtype, sliding_window", [(torch.float32, None), (torch.float16, None),
                                                         (torch.float32, 6)])
def test_the_triton_prefill_kernel_reads_fp8_caches_as_the_torch_twin(name, query_dtype, sliding_window):
    """Prefix hits, a whole prompt and a one-token step in one launch, over a cache whose other blocks are
    poisoned (0xFF is NaN in both fp8 formats)."""
    seq_lens, q_lens = [13, 5, 20], [4, 5, 1]
    tables, lens, slots = paged_batch(seq_lens)
    key, value = kv_sample(len(slots))
    q = calibrated(name, key, value)
    cache = reshape_and_cache_quantized(key, value, poisoned_cache(q), slots, q)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    queries = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM).to(query_dtype)
    out = paged_prefill(queries.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE), cu.to(DEVICE),
                        sliding_window=sliding_window, k_scale=q.k_scale.to(DEVICE), v_scale=q.v_scale.to(DEVICE))
    plan = plan_paged_attention(cache, tables, lens, cu, sum(q_lens), sliding_window)
    expected = paged_attention_torch_quantized(queries, cache, plan, q)
    assert out.dtype == query_dtype and bool(out.isfinite().all())
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2  # fp16: the kernel rounds K and V to the query dtype
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_an_fp8_prefills_tile_map_follows_the_query_dtype(monkeypatch):
    """On a GPU the launch sizes its query tile by the query's dtype (fp32 dots get smaller tiles), not by the
    fp8 cache's: a tile map made for the cache's would list too few tiles and leave new tokens out."""
    prefill = importlib.import_module("kvlab.kernels.paged_prefill")
    monkeypatch.setattr(prefill, "_capability", lambda device: (9, 0))
    cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)
    lens, cu = torch.tensor([90], dtype=torch.int32), torch.tensor([0, 90], dtype=torch.int32)
    block_q = prefill.prefill_launch_config(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                                            capability=(9, 0))["BLOCK_Q"]
    tiles = prefill.prefill_tile_map(NUM_HEADS, cache, cu, lens, torch.float32)
    assert tiles[:, 1].tolist() == list(range(0, 90, block_q))[::-1]


@pytest.mark.skipif(ON_GPU, reason="the interpreter's refusal; compiled, the write runs")
def test_reshape_and_cache_into_fp8_says_the_interpreter_cannot():
    key, value = kv_sample(2)
    q = calibrated("fp8_e4m3", key, value)
    cache = poisoned_cache(q)
    with pytest.raises(UnsupportedError, match="interpreter rounds float -> fp8 wrongly"):
        reshape_and_cache(key, value, cache, torch.tensor([0, 1]), k_scale=q.k_scale, v_scale=q.v_scale)
    assert bool((cache.view(torch.uint8) == 0xFF).all())


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fp8_kernels_refuse_missing_or_stray_scales(kernel):
    key, value = kv_sample(2)
    q = calibrated("fp8_e4m3", key, value)
    tables, lens, _ = paged_batch([3])
    query = torch.randn(1, NUM_HEADS, HEAD_DIM)
    cu = torch.tensor([0, 1], dtype=torch.int32)

    def attend(cache, **scales):
        if kernel == "decode":
            return paged_attention_decode(query, cache, tables, lens, **scales)
        return paged_prefill(query, cache, tables, lens, cu, **scales)
    with pytest.raises(InvalidArgumentError, match="k_scale must be a torch.Tensor"):
        attend(poisoned_cache(q))
    with pytest.raises(InvalidArgumentError, match="v_scale must hold 2 finite scales > 0"):
        attend(poisoned_cache(q), k_scale=q.k_scale, v_scale=torch.ones(NUM_KV_HEADS + 1))
    with pytest.raises(InvalidArgumentError, match="k_scale and v_scale are for fp8 caches"):
        attend(torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), k_scale=q.k_scale, v_scale=q.v_scale)
