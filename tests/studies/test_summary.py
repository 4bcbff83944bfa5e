"""The summary under the table: ties are ties, and requests the pool could not serve are said."""

import math

import pandas as pd

from kvlab.studies.summary import summary


def rows(capacity, rates, skipped=0, dropped=(0, 0, 0), requests=100, ceiling=0.5):
    return [{"trace": "t", "block_size": 16, "capacity_blocks": capacity, "policy": policy, "hit_rate_tokens": rate,
             "ceiling_hit_rate_tokens": ceiling, "requests": requests - skipped - drop, "requests_skipped": skipped,
             "requests_dropped_mid_decode": drop}
            for policy, rate, drop in zip(["lru", "fifo", "lfu"], rates, dropped)]


def lines(*groups) -> list[str]:
    return summary(pd.DataFrame([row for group in groups for row in group])).splitlines()


def test_a_tie_names_no_best_policy():
    assert lines(rows(10, [0.1, 0.1, 0.1]))[1] == "         10 blocks: all policies tie at 10.0% (20% of the ceiling)"


def test_a_best_policy_is_named_and_a_tie_for_best_names_both():
    assert lines(rows(10, [0.1, 0.2, 0.1]))[1].endswith("best policy fifo hits 20.0% (40% of the ceiling)")
    assert lines(rows(10, [0.2, 0.2, 0.1]))[1].endswith("best policies lru and fifo tie at 20.0% (40% of the ceiling)")


def test_skipped_and_dropped_requests_are_said():
    text = lines(rows(10, [0.1, 0.2, 0.1], skipped=7, dropped=(1, 3, 1)), rows(math.inf, [0.5] * 3))
    assert text[1].endswith("; 7 of 100 requests skipped (prompt larger than the pool); up to 3 of 100 dropped "
                            "mid-decode (outgrew the pool)")
    assert len(text) == 2  # the infinite pool is the ceiling's line


def test_a_trace_without_reuse_has_no_share_of_a_zero_ceiling():
    assert lines(rows(10, [0.0, 0.0, 0.0], ceiling=0.0))[1].endswith("all policies tie at 0.0%")


def test_the_best_row_s_main_miss_causes_are_said():
    causes = {"hit_gpu_tokens": 20, "hit_tier_tokens": 0, "cold_tokens": 50, "evicted_tokens": 25,
              "partial_block_tokens": 5, "group_cut_tokens": 0, "speculative_drop_tokens": 0, "isolated_tokens": 0,
              "recompute_tokens": 0, "tier_miss_tokens": 0, "not_admitted_tokens": 0, "evicted_reuse_distance_p50": 7.0}
    with_causes = [{**row, **causes} for row in rows(10, [0.1, 0.2, 0.1])]
    assert lines(with_causes)[1].endswith("best policy fifo hits 20.0% (40% of the ceiling); misses: 50.0% cold, "
                                          "25.0% evicted, 5.0% partial block (reuse distance p50: 7 admissions)")
