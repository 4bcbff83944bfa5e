"""The KV-format studies' CPU-cheap parts: the capacity study's pools (bytes from kvlab.sizing, replays of the
Mooncake trace's first requests) and the accuracy study's divergence count."""

from pathlib import Path

import pandas as pd

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


RESULTS = Path(__file__).resolve().parents[2] / "data" / "kv_quant"


def test_the_committed_accuracy_study_puts_kivi_near_fp32_at_4_bits_and_shows_where_2_bits_lose():
    """Issue 41's targets on the committed SmolLM2 run: KIVI 4-bit within 3% of fp32's perplexity (met); 2-bit
    within 10% (missed: the attribution shows the keys carry most of the loss, in the fast rotary channels)."""
    accuracy = pd.read_csv(RESULTS / "smollm2_kv_accuracy.csv").set_index("setting")
    ratio = accuracy.ppl / accuracy.ppl_auto
    assert ratio["kivi_int4 G32 R128"] < 1.03 and ratio["kivi_int4 G32 R32"] < 1.03
    assert ratio["kivi_int4 G32 R128"] < ratio["fp8_e4m3 per-head"] < ratio["int4_calibrated_channel"]
    assert ratio["kivi_int2 G32 R128"] > 1.10  # the 2-bit target is missed on this model
    assert ratio["kivi_int2 G32 R128"] < ratio["kivi_int2 G32 R32"] < ratio["kivi_int2 G128 R128"]
    attribution = pd.read_csv(RESULTS / "smollm2_kivi2_attribution.csv").set_index("setting").ppl
    keys, values = attribution["K 2 bits, V 4 bits, every layer"], attribution["K 4 bits, V 2 bits, every layer"]
    assert keys > values > attribution["K 4 bits, V 4 bits, every layer"]
    channels = pd.read_csv(RESULTS / "smollm2_kivi_key_error_by_channel.csv")
    fast = channels.rope_radians_per_token > 0.1
    assert channels[fast].kivi2_rel_error.min() > channels[~fast].kivi2_rel_error.median()
    assert channels.step_change.corr(channels.kivi2_rel_error) > 0.7
