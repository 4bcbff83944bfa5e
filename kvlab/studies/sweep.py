"""Running a study's replays: in this process, in local worker processes, or on a Dask cluster.

The replays of one prepared trace (one per capacity and policy) are dealt into chunks, about two per
worker: a chunk builds the trace's ``Sequence`` objects once for all its replays, and several chunks per
worker keep the workers evenly busy. Each chunk is a pure function of its inputs, whichever process runs
it, so a parallel run's rows equal a serial run's, row for row (only ``wall_s``, a timing, differs).
Chunks run through joblib: ``jobs`` local processes (joblib's loky backend), or, given ``dask_scheduler``,
joblib's Dask backend on that cluster, which ships each prepared trace to a worker once however many
chunks use it.
"""

from contextlib import contextmanager

from joblib import Parallel, delayed, effective_n_jobs, parallel_config
from tqdm.auto import tqdm

from kvlab.studies.engine_model import EngineModel
from kvlab.studies.parallel_options import check_jobs
from kvlab.studies.simulator import PreparedTrace, replay_prepared


def run_replays(tasks: list[tuple], *, engine: EngineModel, workers: int, progress: bool = True,
                kv_cache_metrics_sample: float | None = None) -> list[dict]:
    """The row of each ``(prepared trace, capacity, policy)`` or ``(prepared trace, capacity, policy, tier)`` task,
    in the tasks' order, run inside ``backend(...)``, which gave ``workers``."""
    rows = [None] * len(tasks)
    if not tasks:
        return rows
    chunks = plan(tasks, workers)
    inner = progress and workers == 1  # one worker is this process, where a per-request bar can show
    calls = (delayed(_replay_chunk)(indices, tasks[indices[0]][0], [tasks[i][1:] for i in indices], engine, inner,
                                    kv_cache_metrics_sample) for indices in chunks)
    with tqdm(total=len(tasks), desc="replays", disable=not progress) as bar:
        for indices, replayed in Parallel(n_jobs=min(workers, len(chunks)), return_as="generator_unordered")(calls):
            for i, row in zip(indices, replayed):
                rows[i] = row
            bar.update(len(indices))
    return rows


#: A sequential replay of this many blocks takes a second or more: building the sequences again (~0.1 s for
#: 12k requests) costs little beside it, and one replay per chunk moves the progress bar once per replay.
LONG_REPLAY_BLOCKS = 1_000_000


def plan(tasks: list[tuple[PreparedTrace, object, object]], workers: int) -> list[list[int]]:
    """Task indices per chunk. A prepared trace's tasks are dealt round-robin into chunks (so that each
    chunk gets a mix of capacities and policies), about two chunks per worker in all; overlap replays share
    nothing, and long replays little (``LONG_REPLAY_BLOCKS``), so each of those is a chunk of its own."""
    by_trace: dict[int, list[int]] = {}
    for i, (prepared, *_) in enumerate(tasks):
        by_trace.setdefault(id(prepared), []).append(i)
    chunks = []
    for indices in by_trace.values():
        prepared = tasks[indices[0]][0]
        shared = prepared.mode == "sequential" and prepared.full_blocks < LONG_REPLAY_BLOCKS
        count = min(len(indices), -(-2 * workers // len(by_trace))) if shared else len(indices)
        chunks += [indices[start::count] for start in range(count)]
    return chunks


def _replay_chunk(indices: list[int], prepared: PreparedTrace, configs: list, engine: EngineModel, progress: bool,
                  kv_cache_metrics_sample: float | None = None):
    return indices, replay_prepared(prepared, configs, engine=engine, progress=progress,
                                    kv_cache_metrics_sample=kv_cache_metrics_sample)


@contextmanager
def backend(jobs=None, dask_scheduler: str | None = None, dask_timeout: float = 10.0):
    """Yields how many tasks can run at once under joblib's backend for these settings; with
    ``dask_scheduler``, connected to it (``dask_timeout`` seconds to reach it, as many again for its answer:
    ``kvlab.studies.dask_client``) until the block ends."""
    jobs = check_jobs(jobs)
    if dask_scheduler is None:  # joblib's current backend: loky processes unless the caller chose another
        yield effective_n_jobs(jobs)
        return
    from kvlab.studies.dask_client import connect  # imports distributed, only for cluster runs: it takes a second

    client = connect(dask_scheduler, dask_timeout)
    jobs = -1 if jobs is None else jobs
    with client, parallel_config(backend="dask", n_jobs=jobs):
        yield effective_n_jobs(jobs)
