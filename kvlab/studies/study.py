"""Cache-hit sweeps: every trace x block size x capacity x policy, one DataFrame row per replay.

``cache_hit_study(["mooncake_conversation"], block_sizes=[16], capacities=[1000, 10000, math.inf],
policies=["lru", "lfu", "fifo"])`` replays each combination through the real ``BlockManager``
(``kvlab.studies.simulator``) and returns the rows, with ``ceiling_hit_rate_tokens``: the hit rate of a
cache that never evicts, computed from the trace alone (``kvlab.studies.reuse``). Each trace is read and
prepared once per block size (its block keys, compact prompts), then replayed per capacity and policy;
``jobs`` runs the replays in parallel processes and ``dask_scheduler`` on a Dask cluster
(``kvlab.studies.sweep``). The rows are the same either way, ``wall_s`` aside.

An infinite pool never evicts, so every policy gives it the same hits; it is replayed once per
trace x block size and its row is shared by all policies (``evictions == 0`` is checked; a policy that
evicts anyway, by reusing cached blocks before never-cached ones, is replayed on its own).
"""

import math
import sys
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kvlab.blocks.sequence import check_block_size
from kvlab.errors import InvalidArgumentError
from kvlab.studies.estimate import estimate, slow_notice
from kvlab.studies.doctor import COLUMNS as DOCTOR_COLUMNS
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.parallel_options import check_jobs, check_retries, check_timeout
from kvlab.studies.reuse import block_keys, reuse_profile
from kvlab.studies.simulator import (check_capacity, check_mode, check_sequential_only, infinite_pool_blocks,
                                    policy_factory, prepare)
from kvlab.studies.sweep import RETRIES, SavedRows, backend, run_replays, settings_digest
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.tiers import TIER_COLUMNS, tier_configs
from kvlab.studies.ttft_model import TTFT_COLUMNS, TTFTModel
from kvlab.studies.traces import BUNDLED, check_frame, load_trace
from kvlab.validation import check_optional_int

#: Column order of a study's table and CSV (overlap runs add their engine metrics after these).
COLUMNS = ["trace", "mode", "block_size", "capacity_blocks", "capacity_tokens", "policy", "hit_rate_tokens",
           "hit_rate_blocks", "ceiling_hit_rate_tokens", "prefill_tokens_saved", "prompt_tokens", "evictions",
           "peak_blocks_used", "pool_blocks", "requests", "requests_skipped", "requests_dropped_mid_decode",
           "wall_s", *TIER_COLUMNS, *TTFT_COLUMNS, *DOCTOR_COLUMNS]


def resolve_trace(trace, limit: int | None = None) -> tuple[str, pd.DataFrame]:
    """``(label, frame)`` for a bundled trace name, a synthetic workload name (``WORKLOADS``), a path,
    or a ``(label, DataFrame)`` pair; ``limit`` keeps the first N requests."""
    limit = check_optional_int("limit", limit, 1)
    if isinstance(trace, tuple) and len(trace) == 2 and isinstance(trace[1], pd.DataFrame):
        label, frame = trace
        check_frame(frame)
    elif isinstance(trace, str) and trace in WORKLOADS:
        label, frame = trace, WORKLOADS[trace]()
    elif isinstance(trace, (str, Path)):
        if trace not in BUNDLED and not Path(trace).is_file():  # said here, where the synthetic names are known
            raise InvalidArgumentError(f"trace {str(trace)!r} is neither a trace name "
                                       f"({', '.join([*BUNDLED, *WORKLOADS])}) nor an existing file")
        label = trace if trace in BUNDLED else Path(trace).stem
        return label, load_trace(trace, limit=limit)
    else:
        raise InvalidArgumentError(f"a trace is a name ({', '.join([*BUNDLED, *WORKLOADS])}), a path, or a "
                                   f"(label, DataFrame) pair; got {type(trace).__name__}")
    return label, frame if limit is None else frame.head(limit)


def cache_hit_study(traces=("mooncake_conversation",), *, block_sizes=(16,), capacities=(1000, 10000, math.inf),
                    policies=("lru", "fifo", "lfu"), mode: str = "sequential", limit: int | None = None,
                    engine: EngineModel | None = None, progress: bool = True, jobs: int | None = None,
                    dask_scheduler: str | None = None, dask_timeout: float = 10.0, offload_capacities=(0,),
                    offload_policies=("lru",), offload_admissions=("always",),
                    kv_cache_metrics_sample: float | None = None, ttft: TTFTModel | None = None,
                    rows_file=None, retries: int = RETRIES) -> pd.DataFrame:
    """Replay every combination; returns one row per trace x block size x capacity x policy x offload tier
    (``kvlab.studies.tiers.tier_configs``: 0 is no tier), with the TTFT model's columns (``ttft``, default
    ``TTFTModel()``: kvlab.studies.ttft_model) and, given ``kv_cache_metrics_sample``, residency metrics. ``jobs``:
    parallel workers (None: joblib's current setting, 1 unless set by ``joblib.parallel_config``; -1: all
    cores); ``dask_scheduler``: the address of a Dask scheduler to run on instead (``jobs`` then defaults
    to all of its workers' threads), reached within ``dask_timeout`` seconds and answering within as many
    again. ``rows_file``: a path where each replay's row is saved as it finishes, and from which a sweep started
    again takes the rows it already has (``kvlab.studies.sweep.SavedRows``); ``retries``: how many times a failed
    replay is tried again before a ``ReplayError`` names it (raised after every other replay has finished)."""
    one_trace = isinstance(traces, (str, Path)) or (isinstance(traces, tuple) and len(traces) == 2
                                                     and isinstance(traces[1], pd.DataFrame))
    traces = [traces] if one_trace else list(traces)
    capacities = [check_capacity(c) for c in capacities]
    policies, block_sizes = list(policies), [check_block_size(b) for b in block_sizes]
    names = [policy_factory(policy)[0] for policy in policies]  # fail before hours of replay, not after
    mode, engine, jobs = check_mode(mode), engine or EngineModel(), check_jobs(jobs)
    tiers = tier_configs(offload_capacities, offload_policies, offload_admissions)
    check_sequential_only(mode, tiers, kv_cache_metrics_sample)
    ttft = ttft if ttft is not None else TTFTModel()
    if not isinstance(ttft, TTFTModel):
        raise InvalidArgumentError(f"ttft must be a TTFTModel (kvlab.studies.ttft_model), got {type(ttft).__name__}")
    if mode == "overlap":
        engine.scheduler_config()  # an unknown scheduler or a bad speculative_config fails now, not per replay
    dask_timeout, retries = check_timeout(dask_timeout), check_retries(retries)
    saved = SavedRows(rows_file) if rows_file is not None else None
    if saved is not None:
        saved.load()  # a file that is not a rows file fails now, not after the preparing
    if dask_scheduler is not None:  # a bad address fails before the traces are read, not after
        from kvlab.studies.dask_client import check_address  # imports distributed: a second

        dask_scheduler = check_address(dask_scheduler)
    if not (traces and block_sizes and capacities and policies):
        raise InvalidArgumentError("need at least one trace, block size, capacity and policy")
    frames = [resolve_trace(trace, limit) for trace in traces]  # every trace is read before any replay
    with backend(jobs, dask_scheduler, dask_timeout) as workers:  # a cluster is reached before any preparing
        notice = slow_notice(*estimate(frames, block_sizes, capacities, len(policies) * len(tiers), mode, workers),
                             workers)
        if progress and notice:
            print(notice, file=sys.stderr, flush=True)
        prepared, ceilings = [], []
        with tqdm(total=len(frames) * len(block_sizes), desc="preparing", disable=not progress) as bar:
            for label, frame in frames:
                for block_size in block_sizes:
                    keys = block_keys(frame, block_size)  # once per trace and block size, for every replay
                    ceilings.append(reuse_profile(frame, block_size, keys=keys)["ceiling_hit_rate_tokens"])
                    prepared.append(prepare(frame, block_size, mode, label, keys=keys))
                    if math.inf in capacities:  # refused now, not when its replay starts
                        infinite_pool_blocks(prepared[-1], engine)
                    bar.update()
        run = dict(engine=engine, workers=workers, progress=progress, kv_cache_metrics_sample=kv_cache_metrics_sample,
                   saved=saved, retries=retries)
        # What each replay reads besides its parameters (the trace, the engine model, the metrics' sampling), by
        # trace: a rows file's row stands for a replay only when all of it is the same.
        digests = [settings_digest(engine, kv_cache_metrics_sample, frame=frame) for _, frame in frames]

        def keys(tasks):
            return [_replay_key(p, capacity, policy, tier, digests[prepared.index(p) // len(block_sizes)])
                    for p, capacity, policy, tier in tasks]
        # Each capacity is replayed with every (policy, tier) variant, the infinite pool with the first only: the
        # other variants share its row (it never evicts, so neither the policy nor a tier has anything to do)...
        variants = [(policy, tier) for policy in policies for tier in tiers]
        per_trace = [(c, *variant) for c in capacities for variant in (variants if c != math.inf else variants[:1])]
        tasks = [(p, *config) for p in prepared for config in per_trace]
        replayed = run_replays(tasks, keys(tasks), **run)
        groups = [replayed[g * len(per_trace):(g + 1) * len(per_trace)] for g in range(len(prepared))]
        # ... unless it evicted after all (see the module docstring): then each variant gets its own replay.
        evicted = [g for g, rows in enumerate(groups)
                   if any(row["capacity_blocks"] == math.inf and row["evictions"] for row in rows)]
        tasks = [(prepared[g], c, *variant) for g in evicted for c in capacities if c == math.inf
                 for variant in variants[1:]]
        own = iter(run_replays(tasks, keys(tasks), **run))
    labels = [(name, tier) for name in names for tier in tiers]
    rows = []
    for g, ceiling in enumerate(ceilings):
        rows += [{**row, "ceiling_hit_rate_tokens": ceiling, **ttft.columns(row)}
                 for row in _in_sweep_order(capacities, labels, groups[g], own if g in evicted else None)]
    table = pd.DataFrame(rows)
    return table[COLUMNS + [c for c in table.columns if c not in COLUMNS]]


def _replay_key(prepared, capacity, policy, tier, digest: str) -> dict:
    """A replay's identity in a rows file: its parameters, and the digest of everything else it reads."""
    policy = policy if isinstance(policy, str) else f"{policy.__module__}.{policy.__qualname__}"
    return {"trace": prepared.label, "mode": prepared.mode, "block_size": prepared.block_size,
            "capacity_blocks": capacity, "policy": policy, **tier.labels(), "settings": digest}


def _in_sweep_order(capacities, labels, replayed: list[dict], own) -> list[dict]:
    """One trace x block size's rows, capacity by capacity and (policy, tier) variant by variant (``labels``:
    their names and tiers): an infinite pool's one replay stands for every variant, unless ``own`` (an
    iterator) yields the other variants' own replays."""
    rows, first = [], iter(replayed)
    for capacity in capacities:
        if capacity != math.inf:
            rows += [next(first) for _ in labels]
            continue
        shared = next(first)
        rows += [shared] + [next(own) if own else {**shared, "policy": name, **tier.labels()}
                            for name, tier in labels[1:]]
    return rows
