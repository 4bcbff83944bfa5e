"""The KV-format studies' CPU-cheap parts: the capacity study's pools (bytes from kvlab.sizing, replays of the
Mooncake trace's first requests) and the accuracy study's divergence count."""

from kvlab.studies import kv_capacity
from kvlab.studies.kv_accuracy import tokens_to_divergence


def test_capacity_pools_come_from_each_formats_bytes_per_token():
    # Llama-3-8B: 32 layers x 8 kv heads; per head and token bf16 2 x 256 B, fp8 2 x 128, K fp16 256 + V fp8 128,
    # int4_calibrated_channel K 64 + V 64 + 4 x 128 / 32; KIVI (G = 32) K and V each 128 x b / 8 + 4 x 128 / 32,
    # and its window outside the pages: 128 bf16 tokens for each of 256 sequences
    window = 256 * 128 * 32 * 8 * 512
    assert {label: (per_token, outside) for label, per_token, outside in kv_capacity.formats()} == {
        "bfloat16": (32 * 8 * 512, 0), "k_fp16_v_fp8": (32 * 8 * 384, 0), "fp8": (32 * 8 * 256, 0),
        "int4_calibrated_channel": (32 * 8 * 144, 0), "kivi_int4": (32 * 8 * 160, window),
        "kivi_int2": (32 * 8 * 96, window), "ideal 4-bit (4x)": (32 * 8 * 512 // 4, 0),
        "ideal 2-bit (8x)": (32 * 8 * 512 // 8, 0)}


def test_more_blocks_in_the_budget_never_lower_the_hit_rate():
    table = kv_capacity.run_study(budget_bytes=8 << 30, limit=300)
    table = table.sort_values("pool_blocks")
    assert list(table["pool_blocks"]) == sorted(((8 << 30) - window) // (b * 512)
                                                for b, window in zip(table["bytes_per_token"], table["window_bytes"]))
    assert table["hit_rate_tokens"].is_monotonic_increasing and table["requests"].max() == 300
    assert (table["hit_rate_tokens"] <= table["ceiling_hit_rate_tokens"] + 1e-9).all()


def test_tokens_to_divergence():
    assert tokens_to_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert tokens_to_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert tokens_to_divergence([1, 2, 3], [4, 2, 3]) == 0
