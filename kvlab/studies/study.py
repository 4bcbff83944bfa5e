"""Cache-hit sweeps: every trace x block size x capacity x policy, one DataFrame row per replay.

``cache_hit_study(["mooncake_conversation"], block_sizes=[16], capacities=[1000, 10000, math.inf],
policies=["lru", "lfu", "fifo"])`` replays each combination through the real ``BlockManager``
(``kvlab.studies.simulator.replay``) and returns the rows, with ``ceiling_hit_rate_tokens``: the
hit rate of a cache that never evicts, computed from the trace alone (``kvlab.studies.reuse``).

An infinite pool never evicts, so every policy gives it the same hits; it is replayed once per
trace x block size and its row is shared by all policies (``evictions == 0`` is checked).
"""

import math
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kvlab.errors import InvalidArgumentError
from kvlab.studies.overlap import EngineModel
from kvlab.studies.reuse import reuse_profile
from kvlab.studies.simulator import check_capacity, policy_factory, replay
from kvlab.studies.synthetic import WORKLOADS
from kvlab.traces import BUNDLED, load_trace

#: Column order of a study's table and CSV (overlap runs add their engine metrics after these).
COLUMNS = ["trace", "mode", "block_size", "capacity_blocks", "capacity_tokens", "policy", "hit_rate_tokens",
           "hit_rate_blocks", "ceiling_hit_rate_tokens", "prefill_tokens_saved", "prompt_tokens", "evictions",
           "peak_blocks_used", "pool_blocks", "requests", "requests_skipped", "requests_dropped_mid_decode",
           "wall_s"]


def resolve_trace(trace, limit: int | None = None) -> tuple[str, pd.DataFrame]:
    """``(label, frame)`` for a bundled trace name, a synthetic workload name (``WORKLOADS``), a path,
    or a ``(label, DataFrame)`` pair; ``limit`` keeps the first N requests."""
    if isinstance(trace, tuple) and len(trace) == 2 and isinstance(trace[1], pd.DataFrame):
        label, frame = trace
    elif isinstance(trace, str) and trace in WORKLOADS:
        label, frame = trace, WORKLOADS[trace]()
    elif isinstance(trace, (str, Path)):
        label = trace if trace in BUNDLED else Path(trace).stem
        return label, load_trace(trace, limit=limit)
    else:
        raise InvalidArgumentError(f"a trace is a name ({', '.join([*BUNDLED, *WORKLOADS])}), a path, or a "
                                   f"(label, DataFrame) pair; got {type(trace).__name__}")
    return label, frame if limit is None else frame.head(limit)


def cache_hit_study(traces=("mooncake_conversation",), *, block_sizes=(16,), capacities=(1000, 10000, math.inf),
                    policies=("lru", "fifo", "lfu"), mode: str = "sequential", limit: int | None = None,
                    engine: EngineModel | None = None, progress: bool = True) -> pd.DataFrame:
    """Replay every combination; returns one row per trace x block size x capacity x policy."""
    one_trace = isinstance(traces, (str, Path)) or (isinstance(traces, tuple) and len(traces) == 2
                                                     and isinstance(traces[1], pd.DataFrame))
    traces = [traces] if one_trace else list(traces)
    capacities = [check_capacity(c) for c in capacities]
    policies, block_sizes = list(policies), list(block_sizes)
    for policy in policies:
        policy_factory(policy)  # fail before hours of replay, not after
    for block_size in block_sizes:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block sizes must be positive ints, got {block_size!r}")
    if not (traces and block_sizes and capacities and policies):
        raise InvalidArgumentError("need at least one trace, block size, capacity and policy")
    rows = []
    runs = len(traces) * len(block_sizes) * len(capacities) * len(policies)
    with tqdm(total=runs, desc="replays", disable=not progress) as bar:
        for trace in traces:
            label, frame = resolve_trace(trace, limit)
            for block_size in block_sizes:
                ceiling = reuse_profile(frame, block_size)["ceiling_hit_rate_tokens"]
                for capacity in capacities:
                    shared = None  # the infinite pool's row, replayed once
                    for policy in policies:
                        if shared is None or capacity != math.inf or shared["evictions"]:
                            bar.set_postfix_str(f"{label} bs={block_size} cap={capacity} {policy_factory(policy)[0]}")
                            row = replay(frame, block_size=block_size, capacity=capacity, policy=policy, mode=mode,
                                         engine=engine, label=label)
                            shared = row
                        else:
                            row = {**shared, "policy": policy_factory(policy)[0]}
                        rows.append({**row, "ceiling_hit_rate_tokens": ceiling})
                        bar.update(1)
    table = pd.DataFrame(rows)
    return table[COLUMNS + [c for c in table.columns if c not in COLUMNS]]


def summary(table: pd.DataFrame) -> str:
    """A few sentences a person reads first: the ceiling, and how close each policy gets at each capacity."""
    lines = []
    for (trace, block_size), group in table.groupby(["trace", "block_size"], sort=False):
        ceiling = group["ceiling_hit_rate_tokens"].iloc[0]
        lines.append(f"{trace}, block size {block_size}: an infinite cache would serve {ceiling:.1%} of prompt "
                     "tokens from cache.")
        finite = group[group["capacity_blocks"] != math.inf]
        for capacity, at_capacity in finite.groupby("capacity_blocks", sort=False):
            best = at_capacity.loc[at_capacity["hit_rate_tokens"].idxmax()]
            share = best["hit_rate_tokens"] / ceiling if ceiling else float("nan")
            lines.append(f"  {int(capacity):>9,} blocks: best policy {best['policy']} hits "
                         f"{best['hit_rate_tokens']:.1%} ({share:.0%} of the ceiling)")
    return "\n".join(lines)
