"""The TTFT model, against numbers worked by hand: Llama-3-8B in fp16 at 512-token blocks."""

import pytest

from kvlab.errors import InvalidArgumentError
from kvlab.studies.ttft_model import TTFTModel

# 32 layers x 8 KV heads x 128 head_dim x 2 (K and V) x 2 bytes = 131,072 B per token; x 512 = 64 MiB per block.
BLOCK_BYTES = 32 * 8 * 128 * 2 * 2 * 512
# Two requests, 10,000 prompt tokens, 4,000 of them recomputed, 5 blocks hit in the tier.
ROW = dict(block_size=512, prompt_tokens=10_000, miss_tokens=4_000, tier_hit_blocks=5, requests=2, requests_skipped=0)


def test_bytes_and_prices_per_block():
    model = TTFTModel()
    assert model.bytes_per_block(512) == BLOCK_BYTES == 67_108_864
    assert model.recompute_ms(512) == pytest.approx(10.24)                 # 512 / 50,000 tokens/s
    assert model.transfer_ms(512) == pytest.approx(2.68435456)             # 64 MiB / 25 GB/s
    assert TTFTModel(kv_cache_dtype="fp8").bytes_per_block(512) == BLOCK_BYTES // 2
    assert TTFTModel("llama-3-70b").bytes_per_block(16) == 80 * 8 * 128 * 2 * 2 * 16


def test_a_tier_hit_that_loads_faster_than_it_recomputes_saves_the_difference():
    columns = TTFTModel().columns(ROW)
    assert columns["ttft_no_cache_ms"] == pytest.approx(10_000 * 0.02 / 2)                     # 100 ms
    assert columns["ttft_mean_ms"] == pytest.approx((4_000 * 0.02 + 5 * 2.68435456) / 2)        # 46.71 ms
    assert columns["ttft_tier_gain_ms"] == pytest.approx(5 * (10.24 - 2.68435456) / 2)          # 18.89 ms


def test_a_tier_hit_slower_to_load_than_to_recompute_shows_no_gain():
    slow = TTFTModel(h2d_gb_per_s=5.0)  # 64 MiB / 5 GB/s = 13.42 ms > 10.24 ms
    columns = slow.columns(ROW)
    assert slow.tier_hit_ms(512) == pytest.approx(10.24)
    assert columns["ttft_tier_gain_ms"] == 0
    assert columns["ttft_mean_ms"] == pytest.approx((4_000 + 5 * 512) * 0.02 / 2)             # all recomputed
    assert "a tier hit saves nothing" in slow.describe([512])


def test_skipped_requests_count_in_the_mean():
    assert TTFTModel().columns({**ROW, "requests": 1, "requests_skipped": 3})["ttft_no_cache_ms"] == pytest.approx(50)


def test_the_assumptions_say_every_number():
    text = TTFTModel(prefill_tokens_per_s=20_000, h2d_gb_per_s=50).describe([16, 512])
    assert text.startswith("TTFT model: Llama-3-8B (32 layers x 8 KV heads x 128 head_dim, fp16): 128 KiB of K/V "
                           "per token; prefill 20,000 tokens/s; host to device 50 GB/s.")
    assert "block size 512: 64 MiB per block; recompute 25.6 ms, transfer 1.34 ms: a tier hit saves 24.3 ms." in text
    assert "block size 16: 2 MiB per block" in text and "do not queue" in text


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="gpt-5"), "unknown TTFT model 'gpt-5'; known: llama-3-8b"),
    (dict(kv_cache_dtype="fp4"), "unknown KV cache dtype 'fp4'"),
    (dict(model=["llama-3-8b"]), r"unknown TTFT model \['llama-3-8b'\]; known: llama-3-8b"),
    (dict(kv_cache_dtype={"fp16": 2}), r"unknown KV cache dtype \{'fp16': 2\}"),
    (dict(prefill_tokens_per_s=0), "prefill_tokens_per_s must be a finite number > 0"),
    (dict(h2d_gb_per_s=float("inf")), "h2d_gb_per_s must be a finite number > 0"),
])
def test_bad_assumptions_are_refused(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        TTFTModel(**kwargs)
