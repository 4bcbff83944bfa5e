"""Parallel sweeps: local worker processes and a Dask cluster give the serial run's rows, row for row; a sweep
keeps each row as it finishes, retries what failed (a dead worker's replays too) and resumes from its saved rows."""

import json
import math
import os
import signal

import pandas as pd
import pytest

from kvlab.blocks.eviction import LRUPolicy
from kvlab.errors import InvalidArgumentError, ReplayError
from kvlab.studies import cache_hit_study, sweep
from kvlab.studies.cli import main
from kvlab.studies.fleet_study import fleet_study
from kvlab.studies.simulator import PreparedTrace
from kvlab.studies.sweep import LONG_REPLAY_BLOCKS, SavedRows, plan

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


# A small sweep for the failure tests: 2 finite pools x 2 policies + the infinite pool, shared by both = 5 replays.
SMALL = dict(block_sizes=[16], capacities=[40, 400, math.inf], limit=60, progress=False)


def saved_keys(path) -> list[str]:
    return [json.dumps(json.loads(line)["key"], sort_keys=True) for line in path.read_text().splitlines()]


def lru_that_kills_its_worker(marker):
    """An LRU policy whose first instance made in a worker process kills that process (SIGKILL, mid-replay as
    far as the sweep can tell); later instances, and any in this process, behave."""
    parent = os.getpid()

    class LRUThatKillsItsWorker(LRUPolicy):
        def __init__(self):
            super().__init__()
            if os.getpid() == parent:
                return
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)
    return LRUThatKillsItsWorker


def worker_has_torch() -> bool:
    import sys
    return "torch" in sys.modules


@pytest.mark.parametrize("where", ["local processes", "dask cluster"])
def test_a_worker_killed_mid_sweep_costs_no_row_and_duplicates_none(where, tmp_path, request):
    policy = lru_that_kills_its_worker(tmp_path / "killed")
    expected = cache_hit_study("synthetic_chat", policies=["lru", policy], jobs=1, **SMALL)
    if where == "local processes":
        parallel = dict(jobs=2)
    else:
        cluster = request.getfixturevalue("cluster")
        parallel = dict(dask_scheduler=cluster.scheduler_address)
    table = cache_hit_study("synthetic_chat", policies=["lru", policy], rows_file=tmp_path / "rows.jsonl",
                            **parallel, **SMALL)
    assert (tmp_path / "killed").exists()  # a worker did die
    pd.testing.assert_frame_equal(without_timings(table), without_timings(expected))
    keys = saved_keys(tmp_path / "rows.jsonl")
    assert len(keys) == len(set(keys)) == 5
    if where == "dask cluster":  # cost-model replays need no torch: the workers never import it
        from distributed import Client

        with Client(cluster.scheduler_address) as client:
            client.wait_for_workers(2, timeout=60)  # the nanny restarts the killed one
            assert not any(client.run(worker_has_torch).values())


class LRUThatFails(LRUPolicy):
    """Fails its first ``failures`` instances (counted in this process: the tests run with jobs=1)."""
    failures = 0
    made = 0

    def __init__(self):
        super().__init__()
        type(self).made += 1
        if type(self).made <= self.failures:
            raise RuntimeError(f"failure number {type(self).made}")


@pytest.mark.parametrize("failures, retries, fails", [(2, 2, False), (3, 2, True), (1, 0, True)])
def test_a_failed_replay_is_retried_a_bounded_number_of_times(failures, retries, fails, tmp_path, monkeypatch):
    monkeypatch.setattr(LRUThatFails, "failures", failures)
    monkeypatch.setattr(LRUThatFails, "made", 0)
    kwargs = dict(SMALL, capacities=[40], policies=["lru", LRUThatFails])
    if not fails:
        table = cache_hit_study("synthetic_chat", jobs=1, retries=retries, **kwargs)
        assert LRUThatFails.made == failures + 1 and table["policy"].tolist() == ["lru", "LRUThatFails"]
        return
    with pytest.raises(ReplayError, match=rf"(?s)1 of 2 replays failed on every attempt; the other 1 rows are saved "
                                          rf"in .*rows.jsonl.*capacity_blocks=40, policy=\S*LRUThatFails, .*"
                                          rf"RuntimeError: failure number {retries + 1} \({retries + 1} attempt"):
        cache_hit_study("synthetic_chat", jobs=1, retries=retries, rows_file=tmp_path / "rows.jsonl", **kwargs)
    assert LRUThatFails.made == retries + 1
    assert len(saved_keys(tmp_path / "rows.jsonl")) == 1  # the row that did not fail is kept


def test_one_failing_replay_costs_no_other_row(monkeypatch):
    monkeypatch.setattr(LRUThatFails, "failures", 10)
    monkeypatch.setattr(LRUThatFails, "made", 0)
    with pytest.raises(ReplayError) as error:
        cache_hit_study("synthetic_chat", jobs=1, policies=["lru", LRUThatFails], **SMALL)
    assert [row is None for row in error.value.rows] == [False, True, False, True, False]
    assert "returned in this error's rows" in str(error.value) and isinstance(error.value.__cause__, RuntimeError)


def test_a_failing_replay_costs_no_replay_that_shared_its_chunk(monkeypatch):
    monkeypatch.setattr(LRUThatFails, "failures", 10)
    monkeypatch.setattr(LRUThatFails, "made", 0)
    # The tasks (40, lru), (40, LRUThatFails), (40, fifo), (inf, lru) are dealt into the chunks [0, 2] and [1, 3].
    with pytest.raises(ReplayError, match="1 of 4 replays failed") as error:
        cache_hit_study("synthetic_chat", jobs=1, retries=0, policies=["lru", LRUThatFails, "fifo"],
                        **dict(SMALL, capacities=[40, math.inf]))
    assert [row is None for row in error.value.rows] == [False, True, False, False]
    assert LRUThatFails.made == 2  # in its chunk, then alone


def test_a_sweep_resumes_from_its_saved_rows(tmp_path, monkeypatch):
    rows_file = tmp_path / "rows.jsonl"
    first = cache_hit_study("synthetic_chat", jobs=1, rows_file=rows_file, **SMALL)  # 3 policies: 7 replays
    lines = rows_file.read_text().splitlines()
    assert len(lines) == 7
    # A crash after two rows, the third half written: the sweep started again replays the other five only.
    rows_file.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    replayed = []
    original = sweep.replay_prepared

    def counting(prepared, configs, **kwargs):
        replayed.extend(configs)
        return original(prepared, configs, **kwargs)
    monkeypatch.setattr(sweep, "replay_prepared", counting)
    again = cache_hit_study("synthetic_chat", jobs=1, rows_file=rows_file, **SMALL)
    assert len(replayed) == 5
    pd.testing.assert_frame_equal(without_timings(again), without_timings(first))
    keys = saved_keys(rows_file)
    assert len(keys) == len(set(keys)) == 7
    # Everything saved: nothing is replayed, and the rows (their timings too) are the saved ones.
    replayed.clear()
    pd.testing.assert_frame_equal(cache_hit_study("synthetic_chat", jobs=1, rows_file=rows_file, **SMALL), again)
    assert replayed == []
    # Another trace length is another sweep: its rows are not taken for this one's.
    cache_hit_study("synthetic_chat", jobs=1, rows_file=rows_file, **dict(SMALL, limit=50))
    assert len(replayed) == 7
    # Nor are rows made by other code (an edit of kvlab, another version).
    monkeypatch.setattr(sweep, "code_digest", lambda: "edited")
    cache_hit_study("synthetic_chat", jobs=1, rows_file=rows_file, **SMALL)
    assert len(replayed) == 14


def test_a_fleet_sweep_resumes_from_its_saved_rows(tmp_path, monkeypatch):
    kwargs = dict(block_sizes=[16], capacities=[60], replicas=[1, 2], routers=["round_robin", "cache_aware"],
                  limit=40, progress=False, jobs=1, rows_file=tmp_path / "rows.jsonl")
    first = fleet_study("synthetic_chat", **kwargs)
    assert len(saved_keys(tmp_path / "rows.jsonl")) == 4

    def no_replays(*args, **kwargs):
        raise AssertionError("replayed a saved row")
    monkeypatch.setattr("kvlab.studies.fleet_study.replay_fleet", no_replays)
    pd.testing.assert_frame_equal(fleet_study("synthetic_chat", **kwargs), first)


def test_a_file_that_is_not_a_rows_file_is_refused_before_any_replay(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(InvalidArgumentError, match=r"notes.txt:1 is not a row of a kvlab sweep"):
        cache_hit_study("synthetic_chat", jobs=1, rows_file=notes, **SMALL)
    assert notes.read_text() == "my notes\n"
    with pytest.raises(InvalidArgumentError, match="rows_file must be a path"):
        cache_hit_study("synthetic_chat", jobs=1, rows_file=3, **SMALL)
    with pytest.raises(InvalidArgumentError, match="retries must be"):
        cache_hit_study("synthetic_chat", jobs=1, retries=-1, **SMALL)


def test_the_command_resumes_from_the_rows_beside_its_csv(tmp_path, monkeypatch):
    args = ["--trace", "synthetic_chat", "--limit", "40", "--block-size", "16", "--capacity", "30,inf", "--quiet",
            "--jobs", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    first = pd.read_csv(tmp_path / "study.csv")
    assert len(SavedRows(tmp_path / "study_rows.jsonl").load()) == 4

    def no_replays(*args, **kwargs):
        raise AssertionError("replayed a saved row")
    monkeypatch.setattr("kvlab.studies.sweep.replay_prepared", no_replays)
    assert main(args) == 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "study.csv"), first)


def lru_that_notes_its_worker(directory):
    """An LRU policy that writes, per instance, which process made it and that process's Dask worker's threads."""
    class LRUThatNotesItsWorker(LRUPolicy):
        def __init__(self):
            super().__init__()
            from distributed import get_worker

            threads = get_worker().state.nthreads if os.getpid() != parent else 0
            (directory / f"{os.getpid()}").write_text(str(threads))
    parent = os.getpid()
    return LRUThatNotesItsWorker


def test_a_local_dask_cluster_is_one_of_single_threaded_processes(tmp_path):
    pytest.importorskip("distributed")
    policy = lru_that_notes_its_worker(tmp_path)
    expected = cache_hit_study("synthetic_chat", policies=["lru", policy], jobs=1, **SMALL)
    for note in tmp_path.iterdir():
        note.unlink()
    table = cache_hit_study("synthetic_chat", policies=["lru", policy], jobs=2, dask_scheduler="local", **SMALL)
    pd.testing.assert_frame_equal(without_timings(table), without_timings(expected))
    notes = {int(note.name): note.read_text() for note in tmp_path.iterdir()}
    assert notes and os.getpid() not in notes and set(notes.values()) == {"1"} and len(notes) <= 2
