"""Running a study's replays: in this process, in local worker processes, or on a Dask cluster.

The replays of one prepared trace (one per capacity and policy) are dealt into chunks, about two per
worker: a chunk builds the trace's ``Sequence`` objects once for all its replays, and several chunks per
worker keep the workers evenly busy. Each chunk is a pure function of its inputs, whichever process runs
it, so a parallel run's rows equal a serial run's, row for row (only ``wall_s``, a timing, differs).
Chunks run through joblib: ``jobs`` local processes (joblib's loky backend), or, given ``dask_scheduler``,
joblib's Dask backend on that cluster, which ships each prepared trace to a worker once however many
chunks use it.

A sweep survives failures (``run_sweep``): each finished row is appended to the sweep's rows file (``SavedRows``)
as soon as it arrives, keyed by the replay's parameters; a failed chunk, or one lost with a worker that died, is
retried replay by replay up to ``retries`` times, while the other chunks go on; a replay that fails every attempt
is named in one ``ReplayError`` raised after all the others have finished; and a sweep started again with the same
rows file replays only what the file does not hold.
"""

import functools
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed, effective_n_jobs, parallel_config
from tqdm.auto import tqdm

from kvlab.errors import InvalidArgumentError, ReplayError
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.parallel_options import check_jobs
from kvlab.studies.simulator import PreparedTrace, replay_prepared

#: How many times a failed replay is tried again before the sweep reports it (so 3 attempts in all).
RETRIES = 2


def run_replays(tasks: list[tuple], keys: list[dict], *, engine: EngineModel, workers: int, progress: bool = True,
                kv_cache_metrics_sample: float | None = None, saved: "SavedRows | None" = None,
                retries: int = RETRIES) -> list[dict]:
    """The row of each ``(prepared trace, capacity, policy)`` or ``(prepared trace, capacity, policy, tier)`` task,
    in the tasks' order, run inside ``backend(...)``, which gave ``workers``; ``keys``: each task's identity in
    ``saved`` (``run_sweep``)."""
    inner = progress and workers == 1  # one worker is this process, where a per-request bar can show

    def chunk_call(indices):
        return _replay_chunk, (tasks[indices[0]][0], [tasks[i][1:] for i in indices], engine, inner,
                               kv_cache_metrics_sample)
    return run_sweep(keys, chunk_call, lambda indices: plan([tasks[i] for i in indices], workers, indices),
                     workers=workers, saved=saved, retries=retries, progress=progress, desc="replays")


def run_sweep(keys: list[dict], chunk_call, chunks_of, *, workers: int, saved: "SavedRows | None" = None,
              retries: int = RETRIES, progress: bool = True, desc: str = "replays") -> list[dict]:
    """One row per key, in the keys' order. ``chunk_call(indices)`` gives ``(function, args)``: a call, picklable,
    that returns the rows of those tasks; ``chunks_of(indices)`` deals the tasks to run into chunks. Rows already
    in ``saved`` are not replayed; the others are appended to it as they arrive. A chunk that raises, or that a
    dead worker took with it (joblib's whole run then fails), is run again one task per chunk: a task is tried
    again up to ``retries`` times after it failed alone or was lost with a worker. A task that fails every
    attempt is named in one ``ReplayError``, raised once every other task has finished (and been saved)."""
    names = [_key_text(key) for key in keys]
    found = saved.load() if saved is not None else {}
    rows = [found.get(name) for name in names]
    attempts, errors = [0] * len(keys), [None] * len(keys)
    pending = [i for i, row in enumerate(rows) if row is None]
    chunks = chunks_of(pending) if pending else []
    with tqdm(total=len(keys), initial=len(keys) - len(pending), desc=desc, disable=not progress) as bar:
        while chunks:
            calls = (delayed(_guarded)(indices, *chunk_call(indices)) for indices in chunks)
            results = Parallel(n_jobs=min(workers, len(chunks)), return_as="generator_unordered")(calls)
            failed_now = set()
            while True:
                try:
                    indices, replayed, error = next(results)
                except StopIteration:
                    break
                except Exception as lost:  # not a replay's error: a worker died (loky's TerminatedWorkerError,
                    # Dask's KilledWorker...) and joblib gave up on every chunk still running: each task lost a try
                    for i in (i for chunk in chunks for i in chunk if rows[i] is None and i not in failed_now):
                        attempts[i], errors[i] = attempts[i] + 1, lost
                    break
                if error is not None:
                    failed_now.update(indices)
                    if len(indices) == 1:  # a chunk of several is only split: which of its replays failed is unknown
                        attempts[indices[0]], errors[indices[0]] = attempts[indices[0]] + 1, error
                    continue
                for i, row in zip(indices, replayed):
                    rows[i] = row
                    if saved is not None:
                        saved.append(keys[i], row)
                bar.update(len(indices))
            chunks = [[i] for indices in chunks for i in indices if rows[i] is None and attempts[i] <= retries]
    failed = [i for i, row in enumerate(rows) if row is None]
    if failed:
        report = _failure_report(failed, keys, errors, attempts, saved, len(keys))
        raise ReplayError(report, rows) from errors[failed[0]]
    return rows


def _guarded(indices: list[int], function, args: tuple):
    """``(indices, rows, None)``, or ``(indices, None, the exception)``: a replay's failure is returned, not raised,
    so that joblib carries on with the other chunks."""
    try:
        return indices, function(*args), None
    except Exception as error:
        return indices, None, error


def _failure_report(failed, keys, errors, attempts, saved, total) -> str:
    where = (f"saved in {saved.path}; the same sweep run again replays only the failed ones" if saved is not None
             else "returned in this error's rows")
    lines = [f"{len(failed)} of {total} replays failed on every attempt; the other {total - len(failed)} rows are "
             f"{where}:"]
    lines += [f"  {', '.join(f'{k}={v}' for k, v in keys[i].items() if k != 'settings')}: "
              f"{type(errors[i]).__name__}: {errors[i]} "
              f"({attempts[i]} attempt{'s' * (attempts[i] > 1)})" for i in failed[:10]]
    if len(failed) > 10:
        lines.append(f"  ... and {len(failed) - 10} more")
    return "\n".join(lines)


def _key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True, default=str)


class SavedRows:
    """A sweep's rows file: one JSON line per finished replay, ``{"key": {...}, "row": {...}}``, where the key holds
    the replay's parameters and a digest of everything else it read (``settings_digest``). Each line is appended
    with one write, flushed and synced before the next row is taken, so a crash loses at most the line it was
    writing: a last line without its newline is dropped when the file is read again."""

    def __init__(self, path):
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"rows_file must be a path (str or pathlib.Path), got {type(path).__name__}")
        self.path = Path(path)
        if self.path.is_dir():
            raise InvalidArgumentError(f"cannot keep the sweep's rows in {self.path}: it is a directory")

    def load(self) -> dict[str, dict]:
        """The saved rows by key; drops a torn last line. Raises InvalidArgumentError for any other line that is
        not a saved row (the file is not a rows file: nothing is replaced or appended to it)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"cannot read the rows file {self.path}: {e}") from None
        lines = text.split("\n")
        complete, torn = lines[:-1], lines[-1]
        rows = {}
        for number, line in enumerate(complete, start=1):
            try:
                record = json.loads(line)
                rows[_key_text(record["key"])] = dict(record["row"])
            except (ValueError, KeyError, TypeError):
                raise InvalidArgumentError(f"{self.path}:{number} is not a row of a kvlab sweep; give the sweep "
                                           "another rows file, or move this one away") from None
        if torn:  # the line being written when the last run stopped: cut it, so that the next row starts a line
            with open(self.path, "r+b") as file:
                file.truncate(len(text.encode("utf-8")) - len(torn.encode("utf-8")))
        return rows

    def append(self, key: dict, row: dict) -> None:
        line = json.dumps({"key": key, "row": row}, default=_plain) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)  # only once a row is kept: a refused sweep leaves nothing
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(line)
            file.flush()
            os.fsync(file.fileno())


@functools.cache
def code_digest() -> str:
    """A digest of kvlab's Python source: rows made by other code (another version, or an edit of the block
    manager in a checkout) are never taken for this code's. Reading the package's files takes milliseconds."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _plain(value):
    """numpy scalars as Python's, so that json writes them (and reads back the same numbers)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a row value of type {type(value).__name__} cannot be saved")


def settings_digest(*settings, frame=None) -> str:
    """A short digest of everything a replay reads besides its key's parameters: ``settings`` by ``repr``, a trace
    ``frame`` by content, and kvlab's own code (``code_digest``)."""
    digest = hashlib.sha256(repr((code_digest(), *settings)).encode())
    if frame is not None:
        digest.update(repr(list(frame.columns)).encode())
        for _, column in frame.items():
            values = column.to_numpy()
            if values.dtype != object:
                digest.update(np.ascontiguousarray(values).tobytes())
                continue
            for value in values:  # hash_ids, token_ids: an array, a list or nothing per request
                array = np.asarray(value)
                digest.update(f"{array.dtype}{array.shape}".encode())
                digest.update(array.tobytes() if array.dtype != object else repr(value).encode())
    return digest.hexdigest()[:16]


#: A sequential replay of this many blocks takes a second or more: building the sequences again (~0.1 s for
#: 12k requests) costs little beside it, and one replay per chunk moves the progress bar once per replay.
LONG_REPLAY_BLOCKS = 1_000_000


def plan(tasks: list[tuple[PreparedTrace, object, object]], workers: int, indices=None) -> list[list[int]]:
    """Task indices per chunk. A prepared trace's tasks are dealt round-robin into chunks (so that each
    chunk gets a mix of capacities and policies), about two chunks per worker in all; overlap replays share
    nothing, and long replays little (``LONG_REPLAY_BLOCKS``), so each of those is a chunk of its own.
    ``indices``: the tasks' numbers in the sweep (default: their positions)."""
    by_trace: dict[int, list[int]] = {}
    for i, (prepared, *_) in enumerate(tasks):
        by_trace.setdefault(id(prepared), []).append(i)
    numbers = list(range(len(tasks))) if indices is None else list(indices)
    chunks = []
    for indices in by_trace.values():
        prepared = tasks[indices[0]][0]
        shared = prepared.mode == "sequential" and prepared.full_blocks < LONG_REPLAY_BLOCKS
        count = min(len(indices), -(-2 * workers // len(by_trace))) if shared else len(indices)
        chunks += [[numbers[i] for i in indices[start::count]] for start in range(count)]
    return chunks


def _replay_chunk(prepared: PreparedTrace, configs: list, engine: EngineModel, progress: bool,
                  kv_cache_metrics_sample: float | None = None) -> list[dict]:
    return replay_prepared(prepared, configs, engine=engine, progress=progress,
                           kv_cache_metrics_sample=kv_cache_metrics_sample)


@contextmanager
def backend(jobs=None, dask_scheduler: str | None = None, dask_timeout: float = 10.0):
    """Yields how many tasks can run at once under joblib's backend for these settings; with
    ``dask_scheduler``, connected to it (``dask_timeout`` seconds to reach it, as many again for its answer:
    ``kvlab.studies.dask_client``) until the block ends; ``dask_scheduler="local"`` starts a Dask cluster here,
    of ``jobs`` single-threaded worker processes (default: one per core), and closes it at the end."""
    jobs = check_jobs(jobs)
    if dask_scheduler is None:  # joblib's current backend: loky processes unless the caller chose another
        yield effective_n_jobs(jobs)
        return
    from kvlab.studies.dask_client import LOCAL, connect, local_client  # imports distributed: it takes a second

    jobs = -1 if jobs is None else jobs
    client = local_client(effective_n_jobs(jobs)) if dask_scheduler == LOCAL else connect(dask_scheduler, dask_timeout)
    with client, parallel_config(backend="dask", n_jobs=jobs):
        yield effective_n_jobs(jobs)
