"""A fleet: a trace's arrivals routed across N replicas, each a BlockManager in the overlap replay's engine.

``replay_fleet(trace, block_size=512, capacity=2000, replicas=8, router="kv_cost")`` returns one row of
metrics. Each replica is ``kvlab.studies.overlap``'s continuous-batching engine (same time model, same
assumptions) on its own pool of ``capacity`` blocks, publishing KV events (``kvlab.blocks.events``) to
the router. Requests are routed one at a time in arrival order: first every replica runs the steps that
start before the arrival, then the router (``kvlab.studies.routers``) picks a replica from their KV events
and queues (a ``Replica`` shows it those and nothing else), and the request joins that replica's queue at
its next step. With one replica this is exactly the overlap study's replay.

``tier=TierSettings(kind="local"|"shared", capacity=...)`` adds a second tier behind the GPU pools: one per
replica, or one the whole fleet shares (Mooncake's global store), at equal total memory, a promoted block
costing its transfer time (``kvlab.studies.fleet_tier``). ``engine.scheduling_policy`` "lpm" admits each
replica's waiting requests longest cached prefix first (``kvlab.engine.queue_order``).

Metrics: hit_rate_tokens and hit_rate_blocks as in study.csv (prompt tokens served from a cache / all
prompt tokens of the trace; full prompt blocks hit / all full prompt blocks), summed over the replicas;
load_imbalance = max over mean of the replicas' prefill tokens (the uncached prompt tokens each computed,
recomputations included; 1.0 is perfect balance); ttft_p50_s / ttft_p99_s: arrival to the end of the step
that samples the request's first token (queueing, then the steps that compute its prompt, the last chunk's
step included: each ``decode_step_ms`` plus the prompt tokens it computes), over the requests that got one;
evictions, preemptions and requests summed; makespan_s the last replica's clock.
The hit-rate doctor's columns (kvlab.studies.doctor), summed over the replicas, each replica's doctor knowing
its own pool's history only: a prompt whose blocks another replica caches is "cold" where it was routed.
Per tier (``fleet_tier.tier_columns``): gpu_hit_blocks + tier_hit_blocks = the full prompt blocks hit,
tier_hit_rate_blocks the tier's share of all full prompt blocks, tier_capacity_blocks the tier memory held.
"""

import dataclasses
import math
import time

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from kvlab.blocks.prefix_cache import block_hashes
from kvlab.blocks.events import CachedHashes
from kvlab.blocks.manager import MAX_BLOCKS
from kvlab.blocks.sequence import check_block_size
from kvlab.errors import InvalidArgumentError
from kvlab.studies.doctor import HitDoctor, columns as doctor_columns
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.fleet_tier import TierSettings, fleet_managers, tier_columns
from kvlab.studies.overlap import Engine, arrivals
from kvlab.studies.routers import RouterSettings, router_factory
from kvlab.studies.simulator import policy_factory
from kvlab.studies.traces import PromptTokens, check_frame
from kvlab.validation import check_int, is_int

#: The most replicas a fleet may have: a router scans every replica per request.
MAX_REPLICAS = 1024


class Replica:
    """One replica as its router sees it (``routers.ReplicaView``): the hashes its KV events say it caches,
    and its queue. Nothing else of the engine or its pool is reachable through it."""
    __slots__ = ("cached", "_engine")

    def __init__(self, engine: Engine, manager):
        self._engine, self.cached = engine, CachedHashes()
        manager.kv_events.subscribe(self.cached)

    def in_flight(self) -> int:
        return self._engine.in_flight()

    @property
    def waiting_tokens(self) -> int:
        return self._engine.waiting_tokens


def check_replicas(replicas) -> int:
    return check_int("replicas", replicas, 1, MAX_REPLICAS)


def check_capacity(capacity) -> int:
    """Blocks per replica: a whole number (an infinite pool would never show what routing does to a cache)."""
    return check_int("capacity (blocks per replica)", capacity, 1, MAX_BLOCKS)


def replay_fleet(trace: pd.DataFrame, *, block_size: int = 512, capacity: int = 2000, replicas: int = 8,
                 router="round_robin", settings: RouterSettings | None = None,
                 engine: EngineModel | None = None, policy="lru", label: str = "trace",
                 progress: bool = False, tier: TierSettings | None = None) -> dict:
    """Route and replay ``trace`` once; returns the row described in the module docstring. ``router``: a name
    in ``routers.ROUTERS``, a ``routers.Router`` subclass or a ``choose`` function (``kvlab.studies.routers``)."""
    check_frame(trace)
    bs, capacity, n = check_block_size(block_size), check_capacity(capacity), check_replicas(replicas)
    (router, make_router), settings = router_factory(router), settings or RouterSettings()
    engine, (policy_name, policy_class) = engine or EngineModel(), policy_factory(policy)
    engine.scheduler_config()  # an unknown scheduler or a bad speculative_config fails before any replay
    tier = tier or TierSettings()
    if not isinstance(tier, TierSettings):
        raise InvalidArgumentError(f"tier must be a kvlab.studies.fleet_tier.TierSettings, got {tier!r}")
    engine = dataclasses.replace(engine, tier_ms_per_block=tier.ms_per_block(bs))
    start = time.perf_counter()
    prompts, jobs = PromptTokens(trace), arrivals(trace, engine)
    chooser = make_router(settings, bs)
    with tqdm(total=len(jobs), disable=not progress, leave=False, mininterval=0.5,
              desc=f"{label} bs={bs} cap={capacity} x{n} {router} {tier.kind}") as bar:
        managers = fleet_managers(tier, n, capacity, bs, policy_class)
        doctors = [HitDoctor(manager) for manager in managers]  # each replica's causes (kvlab.studies.doctor)
        engines = [Engine(prompts, [], manager, engine, bar, doctor=doctor)
                   for manager, doctor in zip(managers, doctors)]
        fleet = [Replica(e, manager) for e, manager in zip(engines, managers)]  # all the router sees
        next_start = [0.0] * n  # when each engine's next step would start, given what it was pushed so far
        advance = _advance_in_time_order if tier.kind == "shared" else _advance_each
        for job in jobs:
            arrival = job.arrival_ms
            advance(engines, next_start, arrival)
            limit = (job.prompt_len - 1) // bs  # blocks a prompt can hit: its last token is always computed
            hashes = block_hashes(prompts[job.index], bs, 0, limit, None)[0] if chooser.needs_hashes else []
            i = _checked_choice(chooser.choose(fleet, job.prompt_len, hashes), n, router)
            engines[i].push(job)
            next_start[i] = -math.inf  # its next step may come sooner now
        advance(engines, next_start, math.inf)
    row = _row(trace, label, bs, capacity, n, router, policy_name, engines, managers, time.perf_counter() - start)
    return {**row, **doctor_columns(doctors), "scheduling_policy": engine.scheduling_policy, "tier_ms_per_block": engine.tier_ms_per_block,
            **tier_columns(tier, managers, row["hit_rate_blocks"], int((trace["input_length"] // bs).sum()))}


def _advance_each(engines, next_start: list, limit: float) -> None:
    """Run every replica's steps that start before ``limit``, one replica after the other (they share nothing)."""
    for i, e in enumerate(engines):
        if next_start[i] < limit:
            next_start[i] = e.advance(limit)


def _advance_in_time_order(engines, next_start: list, limit: float) -> None:
    """The same, in the order of the steps' start times across replicas: with a shared tier a step must see
    what every replica offloaded before it started, and nothing after. The replica whose next step starts first
    runs until another's would start (a run of plain decode steps touches no tier, so a fast-forwarded one
    can be taken whole)."""
    while True:
        order = sorted(range(len(engines)), key=lambda j: next_start[j])
        first = order[0]
        if next_start[first] >= limit:
            return
        if next_start[first] == -math.inf:  # pushed to: where its clock stands
            next_start[first] = engines[first].now_ms
            continue
        until = min(limit, next_start[order[1]]) if len(order) > 1 else limit
        next_start[first] = engines[first].advance(max(until, math.nextafter(next_start[first], math.inf)))


def _checked_choice(choice, n: int, router: str) -> int:
    if not is_int(choice) or not 0 <= choice < n:
        raise InvalidArgumentError(f"router {router!r} chose {choice!r}: choose must return a replica index, an "
                                   f"int in [0, {n})")
    return int(choice)


def _row(trace, label, bs, capacity, n, router, policy_name, engines, managers, wall_s) -> dict:
    lengths = trace["input_length"].to_numpy(np.int64)
    prompt_tokens, full_blocks = int(lengths.sum()), int((lengths // bs).sum())
    metrics = [e.metrics() for e in engines]
    hit_tokens, hit_blocks = (sum(m[k] for m in metrics) for k in ("hit_tokens", "hit_blocks"))
    prefill = np.array([e.prefill_tokens for e in engines], dtype=np.float64)
    ttft = np.concatenate([np.asarray(e.ttft_ms) for e in engines]) / 1000.0
    total = {k: sum(m[k] for m in metrics) for k in ("requests", "requests_skipped", "requests_dropped_mid_decode",
                                                      "preemptions", "recomputed_tokens")}
    return {
        "trace": label, "block_size": bs, "replicas": n, "capacity_blocks": capacity, "router": router,
        "hit_rate_blocks": hit_blocks / max(full_blocks, 1), "hit_rate_tokens": hit_tokens / prompt_tokens,
        "load_imbalance": float(prefill.max() / prefill.mean()) if prefill.sum() else 1.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else 0.0,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else 0.0,
        "policy": policy_name, "prompt_tokens": prompt_tokens, "prefill_tokens_saved": hit_tokens, **total,
        "evictions": sum(manager.num_evictions for manager in managers),
        "makespan_s": max(m["makespan_s"] for m in metrics), "wall_s": wall_s,
    }
