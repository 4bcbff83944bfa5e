"""Residency metrics (vLLM's KVCacheMetricsCollector): lifetime, idle before eviction and reuse gaps of sampled
blocks, on a hand-driven clock, in both tiers; off unless asked."""

import math

import pytest

from kvlab import BlockManager, Sequence
from kvlab.blocks.events import KVCacheMetricsCollector, ResidencyEvent, describe
from kvlab.errors import InvalidArgumentError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(manager, clock, schedule):
    """Allocate then free each (time, tokens) prompt at its time."""
    for at, tokens in schedule:
        clock.now = at
        seq = Sequence(tokens, 2)
        manager.allocate(seq)
        manager.free(seq)


def test_lifetime_idle_and_reuse_gaps_of_one_block():
    clock = Clock()
    metrics = KVCacheMetricsCollector(1.0, clock=clock)
    manager = BlockManager(2, 2, kv_cache_metrics=metrics)
    # [1, 2] is sealed at 1 s and hit at 3, 4 and 8 s; [5, 6, 7] at 10 s needs both blocks and evicts it.
    run(manager, clock, [(1, [1, 2, 3]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 3]), (10, [5, 6, 7])])
    assert metrics.drain_events() == [ResidencyEvent("GPU", 9.0, 2.0, (1.0, 4.0))]
    assert metrics.events == []


def test_the_access_history_keeps_the_last_four_as_vllm():
    clock = Clock()
    metrics = KVCacheMetricsCollector(1.0, clock=clock)
    manager = BlockManager(2, 2, kv_cache_metrics=metrics)
    run(manager, clock, [(0, [1, 2, 3])] + [(t, [1, 2, 3]) for t in (1, 2, 4, 8, 16, 32)] + [(40, [5, 6, 7])])
    (event,) = metrics.events
    assert event.reuse_gaps_s == (4.0, 8.0, 16.0) and event.lifetime_s == 40 and event.idle_s == 8


def test_the_tier_has_its_own_events():
    clock = Clock()
    metrics = KVCacheMetricsCollector(1.0, clock=clock)
    manager = BlockManager(2, 2, kv_cache_metrics=metrics, num_offload_blocks=1)
    # [1, 2] enters the one slot at 2 s and is promoted back at 5 s (an access), where [5, 6], evicted from the
    # pool by the same allocate, takes its slot: lifetime 3 s, idle 0. [5, 6] leaves it at 7 s for [8, 9].
    run(manager, clock, [(0, [1, 2, 3]), (2, [5, 6, 7]), (5, [1, 2, 3]), (7, [8, 9, 7])])
    cpu = [event for event in metrics.events if event.medium == "CPU"]
    assert cpu == [ResidencyEvent("CPU", 3.0, 0.0, ()), ResidencyEvent("CPU", 2.0, 2.0, ())]
    assert metrics.summary("CPU")["lifetime_s_count"] == 2 and metrics.summary("CPU")["idle_s_p50"] == 1.0


def test_sampling_is_seeded_and_about_the_rate():
    def sampled(seed):
        clock = Clock()
        metrics = KVCacheMetricsCollector(0.25, clock=clock, seed=seed)
        manager = BlockManager(4, 2, kv_cache_metrics=metrics)
        run(manager, clock, [(t, [2 * t, 2 * t + 1, 0]) for t in range(400)])
        return [event.lifetime_s for event in metrics.events]

    assert sampled(0) == sampled(0) != sampled(1)
    assert 60 <= len(sampled(0)) <= 140  # about a quarter of ~400 evictions


def test_reset_prefix_cache_forgets_everything():
    clock = Clock()
    metrics = KVCacheMetricsCollector(1.0, clock=clock)
    manager = BlockManager(2, 2, kv_cache_metrics=metrics)
    run(manager, clock, [(0, [1, 2, 3]), (1, [5, 6, 7])])
    assert metrics.events and manager.reset_prefix_cache()
    run(manager, clock, [(2, [8, 9, 7])])
    assert metrics.events == []


def test_off_unless_asked_the_manager_reports_to_no_sink():
    assert BlockManager(4, 2)._sink is None and BlockManager(4, 2).kv_cache_metrics is None
    metrics = KVCacheMetricsCollector()
    assert BlockManager(4, 2, kv_cache_metrics=metrics).kv_cache_metrics is metrics


def test_the_summary_of_no_events_is_nan_with_a_zero_count():
    summary = KVCacheMetricsCollector().summary()
    assert summary["lifetime_s_count"] == 0 and math.isnan(summary["reuse_gap_s_p99"])
    assert describe("x", [1, 2, 3, 4]) == {"x_count": 4, "x_mean": 2.5, "x_p50": 2.5, "x_p90": pytest.approx(3.7),
                                           "x_p99": pytest.approx(3.97)}


@pytest.mark.parametrize("rate", [0, -0.1, 1.01, float("nan")])
def test_a_bad_sample_rate_is_refused(rate):
    with pytest.raises(InvalidArgumentError, match="sample_rate"):
        KVCacheMetricsCollector(rate)


def test_anything_else_as_kv_cache_metrics_is_refused():
    with pytest.raises(InvalidArgumentError, match="kv_cache_metrics must be a KVCacheMetricsCollector"):
        BlockManager(4, 2, kv_cache_metrics=True)
