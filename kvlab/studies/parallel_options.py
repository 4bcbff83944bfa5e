"""Checking how a study's replays run in parallel (``kvlab.studies.sweep``) and how long a Dask cluster may
take to answer (``kvlab.studies.dask_client``); the studies check both before anything is replayed."""

from kvlab.validation import check_int, check_number, is_int


def check_jobs(jobs):
    """None (joblib's current setting: 1 unless inside ``joblib.parallel_config``), -1 (every core, or every
    Dask worker thread) or a number of parallel workers >= 1."""
    return jobs if jobs is None or (is_int(jobs) and jobs == -1) else check_int("jobs", jobs, 1)


def check_timeout(seconds) -> float:
    """A Dask scheduler's timeout: a finite number of seconds > 0."""
    return check_number("dask_timeout (seconds)", seconds, 0, min_open=True)


def check_retries(retries) -> int:
    """How many times a failed replay is tried again: an int >= 0."""
    return check_int("retries", retries, 0)
