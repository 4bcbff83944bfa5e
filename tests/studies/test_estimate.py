"""A slow or memory-hungry study says so, with what makes it quicker, before it prepares anything."""

import math
import re

import pytest

from kvlab.studies import cache_hit_study
from kvlab.studies.estimate import BYTES_PER_POOL_BLOCK, estimate, slow_notice
from kvlab.studies.simulator import MAX_CAPACITY
from kvlab.studies.traces import load_trace

MAIN_CAPACITIES = [1000, 2000, 4000, 8000, 16000, 32000, 64000, math.inf]


@pytest.fixture(scope="module")
def mooncake():
    return [("mooncake_conversation", load_trace("mooncake_conversation"))]


def test_the_main_job_is_not_slow_and_block_size_3_is(mooncake):
    seconds, pool = estimate(mooncake, [512], MAIN_CAPACITIES, 3, "sequential", workers=2)
    assert seconds < 60 and slow_notice(seconds, pool, 2) is None
    seconds, pool = estimate(mooncake, [3], MAIN_CAPACITIES, 3, "sequential", workers=2)
    assert seconds > 5 * 60 and pool == MAX_CAPACITY * BYTES_PER_POOL_BLOCK  # the largest pool a manager holds
    notice = slow_notice(seconds, pool, 2)
    assert re.search(r"roughly \d+ minutes on 2 workers, .* up to 5\.5 GiB of memory", notice), notice
    assert "--block-size" in notice and "--limit" in notice
    assert "block_sizes" in notice and "limit" in notice  # a notebook calls cache_hit_study, not the command


class Stop(Exception):
    pass


def test_the_main_job_in_overlap_mode_says_it_takes_minutes(mooncake):
    # It runs the engine's scheduler in every step where something changes (kvlab.studies.overlap): minutes,
    # where the sequential study takes seconds.
    seconds, pool = estimate(mooncake, [512], MAIN_CAPACITIES, 3, "overlap", workers=2)
    assert 5 * 60 < seconds < 30 * 60
    assert re.search(r"roughly \d+ minutes on 2 workers", slow_notice(seconds, pool, 2))


def test_a_slow_study_says_so_before_preparing(monkeypatch, capsys):
    def stop(*args, **kwargs):
        raise Stop
    monkeypatch.setattr("kvlab.studies.study.block_keys", stop)
    with pytest.raises(Stop):
        cache_hit_study("mooncake_conversation", block_sizes=[16], capacities=[1000, 10000, math.inf], jobs=2)
    err = capsys.readouterr().err
    assert "kvlab study: this study will take roughly" in err and "GiB of memory" in err


def test_a_quick_study_says_nothing_of_the_kind(capsys):
    cache_hit_study("synthetic_parallel", limit=8, capacities=[math.inf], policies=["lru"], jobs=1)
    err = capsys.readouterr().err
    assert "preparing" in err and "replays" in err and "will take roughly" not in err


def test_every_replay_bar_ends_full(monkeypatch):
    """The sequential replay counts its requests in batches of 256: the remainder must reach the bar too (a
    notebook's bar left at 94% ends red)."""
    bars = []

    class Bar:
        def __init__(self, total=None, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("kvlab.studies.simulator.tqdm", Bar)
    cache_hit_study("synthetic_parallel", limit=300, capacities=[math.inf], policies=["lru"], jobs=1)
    assert bars and all(bar.n == bar.total for bar in bars), [(bar.n, bar.total) for bar in bars]
