"""Fleet sweeps: every block size x capacity x replica count x router x tier x scheduling policy of one trace, one
row per replay.

``fleet_study("mooncake_conversation", replicas=[1, 8], routers=ROUTERS)`` replays each combination
(``kvlab.studies.fleet``; ``tiers``: ``fleet_tier.TierSettings``, e.g. none, local and shared at one tier
capacity; ``scheduling_policies``: "fcfs" and/or "lpm", as ``EngineModel.scheduling_policy``) and returns a
DataFrame in ``FLEET_COLUMNS`` order. Replays share nothing, so each is one joblib task: ``jobs`` local
processes, or a Dask cluster (``kvlab.studies.sweep.backend``); the rows are the same either way, ``wall_s``
aside.
"""

import dataclasses

import pandas as pd
from kvlab.blocks.sequence import check_block_size
from kvlab.errors import InvalidArgumentError
from kvlab.studies.fleet import check_capacity, check_replicas, replay_fleet
from kvlab.studies.fleet_tier import TierSettings
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.doctor import COLUMNS as DOCTOR_COLUMNS
from kvlab.studies.parallel_options import check_jobs, check_retries, check_timeout
from kvlab.studies.routers import RouterSettings, router_factory
from kvlab.studies.study import resolve_trace
from kvlab.studies.sweep import RETRIES, SavedRows, backend, run_sweep, settings_digest

FLEET_COLUMNS = ["trace", "block_size", "replicas", "capacity_blocks", "router", "hit_rate_blocks",
                 "hit_rate_tokens", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "policy", "prompt_tokens",
                 "prefill_tokens_saved", "requests", "requests_skipped", "requests_dropped_mid_decode",
                 "preemptions", "recomputed_tokens", "evictions", "makespan_s", "scheduling_policy", "tier",
                 "tier_capacity_blocks", "gpu_hit_rate_blocks", "tier_hit_rate_blocks", "tier_hit_blocks",
                 "offloaded_blocks", "tier_ms_per_block", "wall_s", *DOCTOR_COLUMNS]


def fleet_study(trace="mooncake_conversation", *, block_sizes=(512,), capacities=(2000,), replicas=(1, 8),
                routers=("round_robin", "least_loaded", "cache_aware", "kv_cost"),
                settings: RouterSettings | None = None, engine: EngineModel | None = None,
                limit: int | None = None, progress: bool = True, jobs: int | None = None,
                dask_scheduler: str | None = None, dask_timeout: float = 10.0, tiers=(TierSettings(),),
                scheduling_policies=("fcfs",), rows_file=None, retries: int = RETRIES) -> pd.DataFrame:
    """Replay every combination; ``jobs``, ``dask_scheduler``, ``rows_file`` and ``retries`` as in
    ``cache_hit_study``. ``routers``: names
    in ``routers.ROUTERS``, ``Router`` subclasses or ``choose`` functions (``kvlab.studies.routers``)."""
    block_sizes = [check_block_size(b) for b in block_sizes]
    capacities = [check_capacity(c) for c in capacities]
    replicas, routers = [check_replicas(n) for n in replicas], list(routers)
    for router in routers:  # names, Router subclasses or choose functions (kvlab.studies.routers)
        router_factory(router)
    tiers, scheduling_policies = list(tiers), list(scheduling_policies)
    if not (block_sizes and capacities and replicas and routers and tiers and scheduling_policies):
        raise InvalidArgumentError("need at least one block size, capacity, replica count, router, tier and "
                                   "scheduling policy")
    for tier in tiers:
        if not isinstance(tier, TierSettings):
            raise InvalidArgumentError(f"tiers must be kvlab.studies.fleet_tier.TierSettings, got {tier!r}")
    settings, engine, jobs = settings or RouterSettings(), engine or EngineModel(), check_jobs(jobs)
    engines = [dataclasses.replace(engine, scheduling_policy=p) for p in scheduling_policies]  # each checked
    engine.scheduler_config()  # an unknown scheduler or a bad speculative_config fails before any replay
    dask_timeout, retries = check_timeout(dask_timeout), check_retries(retries)
    saved = SavedRows(rows_file) if rows_file is not None else None
    if saved is not None:
        saved.load()  # a file that is not a rows file fails now
    if dask_scheduler is not None:
        from kvlab.studies.dask_client import check_address  # imports distributed: a second

        dask_scheduler = check_address(dask_scheduler)
    label, frame = resolve_trace(trace, limit)
    configs = [(b, c, n, r, t, e) for b in block_sizes for c in capacities for n in replicas for r in routers
               for t in tiers for e in engines]
    digest = settings_digest(settings, frame=frame)
    keys = [{"trace": label, "block_size": b, "capacity_blocks": c, "replicas": n, "router": _name(r),
             "tier": repr(t), "engine": repr(e), "settings": digest} for b, c, n, r, t, e in configs]
    with backend(jobs, dask_scheduler, dask_timeout) as workers:
        inner = progress and workers == 1  # only this process can show a per-request bar
        rows = run_sweep(keys, lambda indices: (_replay, (frame, label, configs[indices[0]], settings, inner)),
                         lambda indices: [[i] for i in indices], workers=workers, saved=saved, retries=retries,
                         progress=progress, desc="fleet replays")
    return pd.DataFrame(rows)[FLEET_COLUMNS]


def _name(router) -> str:
    """A router's name in a rows file: a class or function by where it is defined."""
    if isinstance(router, str):
        return router
    return f"{getattr(router, '__module__', '')}.{getattr(router, '__qualname__', type(router).__qualname__)}"


def _replay(frame, label, config, settings, progress) -> list[dict]:
    block_size, capacity, replicas, router, tier, engine = config
    return [replay_fleet(frame, block_size=block_size, capacity=capacity, replicas=replicas, router=router,
                         settings=settings, engine=engine, label=label, progress=progress, tier=tier)]
