"""Parallel sweeps: local worker processes and a Dask cluster give the serial run's rows, row for row."""

import math

import pandas as pd
import pytest

from kvlab.blocks.eviction import LRUPolicy
from kvlab.errors import InvalidArgumentError
from kvlab.studies import cache_hit_study
from kvlab.studies.cli import main
from kvlab.studies.simulator import PreparedTrace
from kvlab.studies.sweep import LONG_REPLAY_BLOCKS, plan

SWEEP = dict(block_sizes=[512, 64], capacities=[40, 400, math.inf], policies=["lru", "fifo", "lfu"], limit=120,
             progress=False)


def without_timings(table: pd.DataFrame) -> pd.DataFrame:
    assert (table["wall_s"] > 0).all()
    return table.drop(columns="wall_s")


@pytest.fixture(scope="module")
def serial():
    return cache_hit_study(["mooncake_conversation", "synthetic_few_shot"], jobs=1, **SWEEP)


def test_local_processes_give_the_serial_rows(serial):
    parallel = cache_hit_study(["mooncake_conversation", "synthetic_few_shot"], jobs=2, **SWEEP)
    pd.testing.assert_frame_equal(without_timings(parallel), without_timings(serial))


def test_overlap_mode_and_a_policy_class_in_parallel():
    class LRUFromTheTests(LRUPolicy):
        """Defined in a function: worker processes cannot import it, they get it pickled by value."""

    kwargs = dict(block_sizes=[16], capacities=[60, math.inf], policies=["lfu", LRUFromTheTests], limit=40,
                  mode="overlap", progress=False)
    tables = [cache_hit_study("synthetic_chat", jobs=jobs, **kwargs) for jobs in (1, 2)]
    pd.testing.assert_frame_equal(*map(without_timings, tables))
    assert tables[0]["policy"].tolist() == ["lfu", "LRUFromTheTests"] * 2 and tables[0]["preemptions"].sum() > 0


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        yield c


def test_a_dask_cluster_gives_the_serial_rows(serial, cluster):
    from distributed import Client, get_task_stream

    with Client(cluster.scheduler_address) as watcher, get_task_stream(watcher) as stream:
        on_cluster = cache_hit_study(["mooncake_conversation", "synthetic_few_shot"],
                                     dask_scheduler=cluster.scheduler_address, **SWEEP)
    pd.testing.assert_frame_equal(without_timings(on_cluster), without_timings(serial))
    assert stream.data and {task["worker"] for task in stream.data} <= set(cluster.scheduler.workers)


def test_the_command_runs_on_a_dask_cluster(cluster, tmp_path):
    args = ["--trace", "azure_code", "--limit", "50", "--block-size", "16", "--capacity", "30,inf", "--quiet"]
    assert main([*args, "--jobs", "1", "--out", str(tmp_path / "here")]) == 0
    assert main([*args, "--dask-scheduler", cluster.scheduler_address, "--out", str(tmp_path / "there")]) == 0
    here, there = (pd.read_csv(tmp_path / d / "study.csv") for d in ("here", "there"))
    pd.testing.assert_frame_equal(without_timings(here), without_timings(there))


@pytest.mark.parametrize("kwargs, message", [(dict(jobs=0), "jobs"), (dict(jobs=True), "jobs"),
                                             (dict(dask_scheduler="no-port"), "Dask scheduler"),
                                             (dict(dask_scheduler=8786), "dask_scheduler must be an address")])
def test_bad_parallel_settings_are_refused(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        cache_hit_study("synthetic_parallel", capacities=[math.inf], policies=["lru"], limit=4, progress=False,
                        **kwargs)


def test_each_trace_is_read_before_any_replay(monkeypatch):
    # A bad second trace fails at once, not after the first trace's replays.
    def no_replays(*args, **kwargs):
        raise AssertionError("replayed before reading every trace")
    monkeypatch.setattr("kvlab.studies.study.run_replays", no_replays)
    with pytest.raises(InvalidArgumentError, match="neither a trace name"):
        cache_hit_study(["azure_code", "no_such_trace"], progress=False)


@pytest.mark.parametrize("full_blocks, chunks", [(LONG_REPLAY_BLOCKS - 1, 4), (LONG_REPLAY_BLOCKS, 12)])
def test_long_replays_are_chunks_of_their_own_so_the_bar_moves_per_replay(full_blocks, chunks):
    prepared = PreparedTrace("t", "sequential", 16, distinct_blocks=1, prompt_tokens=1, full_blocks=full_blocks)
    tasks = [(prepared, capacity, policy)
             for capacity in (10, 100, 1000, math.inf) for policy in ("lru", "fifo", "lfu")]
    assert len(plan(tasks, workers=2)) == chunks
