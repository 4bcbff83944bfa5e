"""Replay a trace through kvlab's real ``BlockManager`` and measure what its prefix cache saves.

``replay(trace, block_size=16, capacity=1000, policy="lru", mode="sequential")`` returns one dict of
metrics. A sweep prepares a trace once per block size (``prepare``) and replays it for each capacity and
policy (``replay_prepared``). Modes:

- ``"sequential"``: requests one at a time in arrival order: allocate the prompt, then free it. Nothing
  else holds blocks, so the whole pool is cache and the result isolates capacity and eviction policy. A
  prompt larger than the pool is skipped and counted (``requests_skipped``). The manager sees compact
  prompts, two token ids per block, with exactly the same hits (``kvlab.studies.sequential``).
- ``"overlap"``: requests overlap in time, decode and compete with the cache for blocks, under the
  continuous-batching model of ``kvlab.studies.overlap`` (its docstring lists every assumption).

``capacity`` is the pool size in blocks (at most ``MAX_CAPACITY``), or ``math.inf``: a pool just large
enough never to evict (distinct full blocks of the trace plus what can be in flight; the ``evictions``
column proves it: 0). ``policy`` is a name in ``kvlab.blocks.eviction.POLICIES`` (lru, fifo, lfu) or an
``EvictionPolicy`` subclass.

Metrics (one row of a study): hit_rate_tokens = prompt tokens served from the cache / all prompt tokens
of the trace; hit_rate_blocks = full prompt blocks hit / all full prompt blocks (hits as counted by the
manager: a prompt's last token is always computed, so a prompt never hits in full; a skipped request
counts as all misses); prefill_tokens_saved = prompt tokens not recomputed; evictions =
``manager.num_evictions``; peak_blocks_used = most blocks referenced at once; wall_s = seconds the replay
took (preparing the trace, done once for a whole sweep, not included).

Sequential replays may put an offload tier behind the pool (a third config item, ``TierConfig``:
``kvlab.studies.tiers``, whose docstring lists the per-tier columns) and sample residency metrics
(``kv_cache_metrics_sample``: kvlab.blocks.events on the trace's arrival clock; columns
``gpu_lifetime_s_p50`` and the like, per medium and metric).
"""

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from kvlab.blocks.eviction import POLICIES, EvictionPolicy
from kvlab.blocks.events import MEDIA, KVCacheMetricsCollector
from kvlab.blocks.manager import MAX_BLOCKS, BlockManager, KVCacheManager
from kvlab.blocks.sequence import check_block_size
from kvlab.errors import InvalidArgumentError
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.doctor import HitDoctor
from kvlab.studies.reuse import block_keys, unit_probe_keys
from kvlab.studies.sequential import COMPACT_BLOCK_SIZE, CompactTrace, ReplayClock, replay_sequential
from kvlab.studies.tiers import TierConfig, tier_columns
from kvlab.studies.traces import check_frame
from kvlab.validation import check_int, check_number

MODES = ("sequential", "overlap")
#: The most blocks a BlockManager holds (its MAX_BLOCKS): a larger pool would be refused only when its replay
#: starts, after the trace was prepared.
MAX_CAPACITY = MAX_BLOCKS


def policy_factory(policy) -> tuple[str, type[EvictionPolicy]]:
    """``(label, class)`` for a policy name or an ``EvictionPolicy`` subclass (a fresh instance per run)."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise InvalidArgumentError(f"unknown eviction policy {policy!r}; known: {', '.join(POLICIES)}")
        return policy, POLICIES[policy]
    if isinstance(policy, type) and issubclass(policy, EvictionPolicy):
        name = next((k for k, v in POLICIES.items() if v is policy), policy.__name__)
        return name, policy
    raise InvalidArgumentError(f"policy must be a name ({', '.join(POLICIES)}) or an EvictionPolicy subclass, "
                               f"got {policy!r}")


def check_capacity(capacity) -> float | int:
    """``math.inf``, or a whole number of blocks in [1, MAX_CAPACITY] (as an int)."""
    if isinstance(capacity, float) and capacity == math.inf:
        return math.inf
    try:
        return check_int("capacity", capacity, 1, MAX_CAPACITY)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"capacity must be a number of blocks in [1, {MAX_CAPACITY:,}] or math.inf, "
                                   f"got {capacity!r}") from None


def check_mode(mode) -> str:
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


@dataclass(frozen=True, eq=False)
class PreparedTrace:
    """A trace made ready to replay at one block size, for any capacity and policy: the number of distinct
    full blocks (which sizes the infinite pool) and what the mode's replay reads, the compact prompts
    (sequential) or the trace itself (overlap)."""
    label: str
    mode: str
    block_size: int
    distinct_blocks: int
    prompt_tokens: int
    full_blocks: int
    compact: CompactTrace | None = None
    frame: pd.DataFrame | None = None

    def __sizeof__(self) -> int:  # see CompactTrace.__sizeof__: lets Dask ship it to each worker once
        return object.__sizeof__(self) + sys.getsizeof(self.compact) + sys.getsizeof(self.frame)


def prepare(trace: pd.DataFrame, block_size: int, mode: str = "sequential", label: str = "trace",
            keys=None) -> PreparedTrace:
    """``keys``: ``block_keys(trace, block_size)`` if already computed."""
    check_frame(trace)
    block_size, mode = check_block_size(block_size), check_mode(mode)
    keys, request = block_keys(trace, block_size) if keys is None else keys
    distinct, numbers = np.unique(keys, return_inverse=True)
    lengths = trace["input_length"].to_numpy(np.int64)
    sequential = mode == "sequential"
    return PreparedTrace(label, mode, block_size, distinct_blocks=len(distinct),
                         prompt_tokens=int(lengths.sum()), full_blocks=int((lengths // block_size).sum()),
                         compact=CompactTrace.build(trace, block_size, numbers.reshape(-1), request,
                                                    unit_probe_keys(trace, block_size))
                         if sequential else None,
                         frame=None if sequential else trace)


def infinite_pool_blocks(prepared: PreparedTrace, engine: EngineModel) -> int:
    """A pool that never evicts: every distinct full prompt block can stay cached, plus room for what is in
    flight. Policies reuse never-cached blocks before evicting, so this bound suffices. Raises
    InvalidArgumentError when that is more than a BlockManager holds."""
    bs = prepared.block_size
    if prepared.mode == "sequential":
        blocks = prepared.distinct_blocks + int(-(-prepared.compact.lengths.max() // bs))
    else:
        # Overlap: each request also seals private decode blocks, and up to max_num_seqs requests are in
        # flight with partial or duplicate (computed twice at once, registered once) blocks.
        prompt = prepared.frame["input_length"].to_numpy()
        final = prompt + np.maximum(prepared.frame["output_length"].to_numpy() - 1, 0)
        decode_blocks = int((final // bs - prompt // bs).sum())
        largest = np.sort(-(-final // bs))[-engine.max_num_seqs:]
        blocks = prepared.distinct_blocks + decode_blocks + int(largest.sum())
    if blocks > MAX_CAPACITY:
        raise InvalidArgumentError(f"{prepared.label} at block size {bs}: a pool that never evicts would need "
                                   f"{blocks:,} blocks, and a block manager holds at most {MAX_CAPACITY:,}; use a "
                                   "larger block size, fewer requests or only finite capacities")
    return blocks


def replay(trace: pd.DataFrame, *, block_size: int = 16, capacity=math.inf, policy="lru",
           mode: str = "sequential", engine: EngineModel | None = None, label: str = "trace",
           progress: bool = False, tier: TierConfig | None = None,
           kv_cache_metrics_sample: float | None = None) -> dict:
    """Replay ``trace`` once; returns the metrics row described in the module docstring."""
    check_capacity(capacity)  # fail before the trace is prepared
    policy_factory(policy)
    check_sequential_only(mode, [tier or TierConfig()], kv_cache_metrics_sample)
    return replay_prepared(prepare(trace, block_size, mode, label), [(capacity, policy, tier or TierConfig())],
                           engine=engine, progress=progress, kv_cache_metrics_sample=kv_cache_metrics_sample)[0]


def check_sequential_only(mode: str, tiers, kv_cache_metrics_sample) -> None:
    """An offload tier and residency metrics are replayed sequentially only: the overlap replay runs the
    engine's scheduler, which has no clock for the metrics and no place to price the tier's copies."""
    if kv_cache_metrics_sample is not None:
        check_number("kv_cache_metrics_sample", kv_cache_metrics_sample, 0, 1, min_open=True)
    if mode != "sequential" and (any(t.blocks for t in tiers) or kv_cache_metrics_sample is not None):
        raise InvalidArgumentError(f"an offload tier and residency metrics are replayed in sequential mode only, "
                                   f"not {mode!r} (drop --offload-capacity / --kv-cache-metrics-sample, or use "
                                   "--mode sequential)")


def replay_prepared(prepared: PreparedTrace, configs, *, engine: EngineModel | None = None,
                    progress: bool = False, kv_cache_metrics_sample: float | None = None) -> list[dict]:
    """One row per ``(capacity, policy)`` or ``(capacity, policy, tier)`` in ``configs``, each as ``replay``
    would return it, replaying a trace prepared by ``prepare``. Sequential replays share the prompts'
    ``Sequence`` objects, built once; each row's wall_s includes an equal share of building them."""
    configs = [(check_capacity(capacity), *policy_factory(policy), tier[0] if tier else TierConfig())
               for capacity, policy, *tier in configs]
    check_sequential_only(prepared.mode, [c[3] for c in configs], kv_cache_metrics_sample)
    engine = engine or EngineModel()
    if prepared.mode == "overlap":
        engine.scheduler_config()  # an unknown scheduler or a bad speculative_config fails before any replay
    started = time.perf_counter()
    sequential = prepared.mode == "sequential"
    sequences = (prepared.compact.sequences(), prepared.compact.unit_probes()) if sequential else None
    shared_s = (time.perf_counter() - started) / max(len(configs), 1)
    return [_replay_one(prepared, capacity, name, policy_class, tier, engine, sequences, progress, shared_s,
                        kv_cache_metrics_sample)
            for capacity, name, policy_class, tier in configs]


def _replay_one(prepared, capacity, policy_name, policy_class, tier, engine, sequences, progress, shared_s,
                sample) -> dict:
    bs, sequential = prepared.block_size, prepared.mode == "sequential"
    start = time.perf_counter()
    pool = capacity if capacity != math.inf else infinite_pool_blocks(prepared, engine)
    clock = ReplayClock() if sample is not None else None
    metrics_collector = KVCacheMetricsCollector(sample, clock=clock) if sample is not None else None
    # A sequential replay drives the manager itself; the engine's scheduler writes its sequences' progress.
    make = BlockManager if sequential else KVCacheManager
    manager = make(pool, COMPACT_BLOCK_SIZE if sequential else bs, eviction=policy_class(),
                   kv_cache_metrics=metrics_collector, **tier.manager_options())
    requests = len(prepared.compact.lengths) if sequential else len(prepared.frame)
    doctor = HitDoctor(manager, block_size=bs)  # every prompt token's cause (kvlab.studies.doctor)
    with tqdm(total=requests, disable=not progress, leave=False, mininterval=0.5,
              desc=f"{prepared.label} bs={bs} cap={capacity} {policy_name}") as bar:
        if sequential:
            metrics = replay_sequential(prepared.compact, sequences[0], manager, bar, clock, doctor, sequences[1])
        else:
            from kvlab.studies.overlap import replay_overlap  # the serving engine's scheduler

            metrics = replay_overlap(prepared.frame, manager, engine, bar, doctor)
    # Rates over the whole trace: a skipped request's prompt counts as computed, so every row of a trace
    # shares one denominator and rows compare across capacities.
    hit_tokens, hit_blocks = metrics.pop("hit_tokens"), metrics.pop("hit_blocks")
    per_tier = tier_columns(tier, metrics.pop("gpu_hit_blocks", hit_blocks), metrics.pop("tier_hit_blocks", 0),
                            metrics.pop("offloaded_blocks", 0), prepared.full_blocks, prepared.prompt_tokens, bs)
    residency = {} if metrics_collector is None else {
        f"{medium.lower()}_{key}": value
        for medium in MEDIA for key, value in metrics_collector.summary(medium).items()}
    return {
        "trace": prepared.label, "mode": prepared.mode, "block_size": bs, "capacity_blocks": capacity,
        "capacity_tokens": capacity * bs, "policy": policy_name, "pool_blocks": pool,
        "prompt_tokens": prepared.prompt_tokens, "prefill_tokens_saved": hit_tokens,
        "hit_rate_tokens": hit_tokens / prepared.prompt_tokens,
        "hit_rate_blocks": hit_blocks / max(prepared.full_blocks, 1),
        **metrics, "evictions": manager.num_evictions, **per_tier, **residency, **doctor.columns(),
        "wall_s": time.perf_counter() - start + shared_s,
    }
