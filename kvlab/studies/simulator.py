"""Replay a trace through kvlab's real ``BlockManager`` and measure what its prefix cache saves.

``replay(trace, block_size=16, capacity=1000, policy="lru", mode="sequential")`` returns one dict of
metrics. Modes:

- ``"sequential"``: requests one at a time in arrival order: allocate the prompt, then free it. Nothing
  else holds blocks, so the whole pool is cache and the result isolates capacity and eviction policy. A
  prompt larger than the pool is skipped and counted (``requests_skipped``).
- ``"overlap"``: requests overlap in time, decode and compete with the cache for blocks, under the
  continuous-batching model of ``kvlab.studies.overlap`` (its docstring lists every assumption).

``capacity`` is the pool size in blocks, or ``math.inf``: a pool just large enough never to evict
(distinct full blocks of the trace plus what can be in flight; the ``evictions`` column proves it: 0).
``policy`` is a name in ``kvlab.eviction.POLICIES`` (lru, fifo, lfu) or an ``EvictionPolicy`` subclass.

Metrics (one row of a study): hit_rate_tokens = prompt tokens served from the cache / all prompt tokens
of the trace; hit_rate_blocks = full prompt blocks hit / all full prompt blocks (hits as counted by the
manager: a prompt's last token is always computed, so a prompt never hits in full; a skipped request
counts as all misses); prefill_tokens_saved = prompt tokens not recomputed; evictions =
``manager.num_evictions``; peak_blocks_used = most blocks referenced at once.
"""

import math
import time

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from kvlab.block_manager import BlockManager
from kvlab.errors import InvalidArgumentError
from kvlab.eviction import POLICIES, EvictionPolicy
from kvlab.sequence import Sequence
from kvlab.studies.overlap import EngineModel, replay_overlap
from kvlab.studies.reuse import block_keys
from kvlab.traces import PromptTokens

MODES = ("sequential", "overlap")


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
    if capacity == math.inf or (isinstance(capacity, (int, np.integer)) and not isinstance(capacity, bool)
                                and capacity >= 1):
        return capacity if capacity == math.inf else int(capacity)
    raise InvalidArgumentError(f"capacity must be a number of blocks >= 1 or math.inf, got {capacity!r}")


def infinite_pool_blocks(trace: pd.DataFrame, block_size: int, mode: str, engine: EngineModel) -> int:
    """A pool that never evicts: every distinct full prompt block can stay cached, plus room for what is in
    flight. Policies reuse never-cached blocks before evicting, so this bound suffices."""
    distinct = len(np.unique(block_keys(trace, block_size)[0]))
    prompt = trace["input_length"].to_numpy()
    if mode == "sequential":
        return distinct + int(-(-prompt.max() // block_size))
    # Overlap: each request also seals private decode blocks, and up to max_num_seqs requests are in
    # flight with partial or duplicate (computed twice at once, registered once) blocks.
    final = prompt + np.maximum(trace["output_length"].to_numpy() - 1, 0)
    decode_blocks = int((final // block_size - prompt // block_size).sum())
    largest = np.sort(-(-final // block_size))[-engine.max_num_seqs:]
    return distinct + decode_blocks + int(largest.sum())


def _replay_sequential(trace: pd.DataFrame, manager: BlockManager, bar) -> dict:
    prompts, bs, pool = PromptTokens(trace), manager.block_size, manager.num_blocks
    lengths = trace["input_length"].to_numpy()
    skipped = peak = 0
    for done, i in enumerate(np.argsort(trace["timestamp"].to_numpy(), kind="stable"), start=1):
        if -(-lengths[i] // bs) > pool:
            skipped += 1
        else:
            seq = Sequence(prompts[i], bs)
            manager.allocate(seq)  # between requests every block is free: a prompt that fits the pool fits now
            peak = max(peak, pool - manager.num_free_blocks)
            manager.free(seq)
        if done % 256 == 0:
            bar.update(256)
    return {"requests": len(trace) - skipped, "requests_skipped": skipped, "requests_dropped_mid_decode": 0,
            "hit_tokens": manager.stats.hit_tokens,
            "hit_blocks": manager.stats.hit_blocks, "peak_blocks_used": peak}


def replay(trace: pd.DataFrame, *, block_size: int = 16, capacity=math.inf, policy="lru",
           mode: str = "sequential", engine: EngineModel | None = None, label: str = "trace",
           progress: bool = False) -> dict:
    """Replay ``trace`` once; returns the metrics row described in the module docstring."""
    if (not isinstance(trace, pd.DataFrame) or not {"timestamp", "input_length", "output_length"} <= set(trace)
            or trace.empty):
        raise InvalidArgumentError("trace must be a non-empty DataFrame with the columns of kvlab.traces.load_trace")
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    capacity = check_capacity(capacity)
    engine = engine or EngineModel()
    policy_name, policy_class = policy_factory(policy)
    start = time.perf_counter()
    pool = capacity if capacity != math.inf else infinite_pool_blocks(trace, block_size, mode, engine)
    manager = BlockManager(pool, block_size, eviction=policy_class())
    with tqdm(total=len(trace), disable=not progress, leave=False, mininterval=0.5,
              desc=f"{label} bs={block_size} cap={capacity} {policy_name}") as bar:
        if mode == "sequential":
            metrics = _replay_sequential(trace, manager, bar)
        else:
            metrics = replay_overlap(trace, manager, engine, bar)
    # Rates over the whole trace: a skipped request's prompt counts as computed, so every row of a trace
    # shares one denominator and rows compare across capacities.
    lengths = trace["input_length"].to_numpy()
    hit_tokens, hit_blocks = metrics.pop("hit_tokens"), metrics.pop("hit_blocks")
    return {
        "trace": label, "mode": mode, "block_size": block_size, "capacity_blocks": capacity,
        "capacity_tokens": capacity * block_size, "policy": policy_name, "pool_blocks": pool,
        "prompt_tokens": int(lengths.sum()), "prefill_tokens_saved": hit_tokens,
        "hit_rate_tokens": hit_tokens / int(lengths.sum()),
        "hit_rate_blocks": hit_blocks / max(int((lengths // block_size).sum()), 1),
        **metrics, "evictions": manager.num_evictions, "wall_s": time.perf_counter() - start,
    }
