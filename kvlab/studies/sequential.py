"""The sequential replay: one request at a time, allocated then freed, on prompts of two tokens per block.

What a prefix cache does with a prompt depends only on which of its full blocks are equal to blocks seen
before, and equality of a full block means equality of the whole prefix it ends (the manager chains each
block to its parent). So the replay hands the manager *compact* prompts: full block i of a request becomes
the two token ids ``2k, 2k + 1``, where k numbers the block's prefix key (``kvlab.studies.reuse``: equal
keys exactly when the first (i + 1) x block_size tokens are equal), and a partial last block becomes one
token, on a manager of block size 2. Every allocate and free then takes, hits, seals, evicts and frees the
same blocks in the same order as with the real tokens: each prompt needs the same number of blocks, its
full blocks match the same earlier blocks, and the manager's rule that a prompt's last token is always
computed keeps the same blocks out of reach (a compact prompt of f full blocks ends with a partial block
exactly when the real one does). Only hits in tokens need the real block size: hit_blocks x block_size.

Why: the manager hashes, copies and compares every block's tokens, 4 KiB at block size 512, for an answer
the keys already hold; compact prompts cut a replay's time by more than half and are built once per trace
and block size, for every capacity and policy replayed on them. ``tests/studies/test_sequential.py`` checks
the rows against replays of the real tokens.
"""

from dataclasses import dataclass
import math

import numpy as np
import pandas as pd

from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.manager import BlockManager, HybridBlockManager
from kvlab.blocks.sequence import Sequence
from kvlab.studies.traces import PromptTokens, load_trace

COMPACT_BLOCK_SIZE = 2  # a full block is two tokens, so that a one-token partial block stays partial


@dataclass(frozen=True, eq=False)
class CompactTrace:
    """A trace at one block size, as the sequential replay reads it: request i (in arrival order) has
    ``lengths[i]`` prompt tokens and the compact prompt ``tokens[ends[i - 1]:ends[i]]``."""
    block_size: int
    lengths: np.ndarray
    tokens: np.ndarray
    ends: np.ndarray
    probes: np.ndarray  # every request's units' probe keys, in arrival order (the hit-rate doctor's)
    arrivals_s: np.ndarray | None = None  # request i's arrival time in seconds (the residency metrics' clock)

    @classmethod
    def build(cls, trace: pd.DataFrame, block_size: int, numbers: np.ndarray, request: np.ndarray,
              probes: np.ndarray) -> "CompactTrace":
        """``numbers``: the full blocks' prefix keys (``kvlab.studies.reuse.block_keys``) renumbered 0, 1, ...
        (so never negative); ``request``: the request of each block, as ``block_keys`` returns it; ``probes``:
        ``kvlab.studies.reuse.unit_probe_keys``, in request order, for the hit-rate doctor."""
        lengths = trace["input_length"].to_numpy(np.int64)
        full, partial = lengths // block_size, (lengths % block_size > 0).astype(np.int64)
        sizes = 2 * full + partial
        order = np.argsort(trace["timestamp"].to_numpy(), kind="stable")
        ends = np.cumsum(sizes[order])  # the prompts are stored in arrival order, the replay's
        start = np.empty_like(sizes)
        start[order] = ends - sizes[order]
        tokens = np.zeros(int(ends[-1]), dtype=np.int64)  # a partial block keeps token 0: it is never hashed
        first = start[request] + 2 * (np.arange(len(numbers)) - (np.cumsum(full) - full)[request])
        tokens[first], tokens[first + 1] = 2 * numbers, 2 * numbers + 1
        units = -(-lengths // block_size)  # the probes, into arrival order: request order[0]'s units, then ...
        first_unit = np.cumsum(units) - units
        arrived = np.repeat(order, units[order])
        offset = np.arange(len(probes)) - np.repeat(np.cumsum(units[order]) - units[order], units[order])
        probes = probes[first_unit[arrived] + offset]
        return cls(block_size, lengths[order], tokens, ends, probes,
                   trace["timestamp"].to_numpy(np.float64)[order] / 1000.0)

    def __sizeof__(self) -> int:
        # Dask's joblib backend ships arguments larger than a kilobyte to its workers once, not once per task;
        # it measures them with sys.getsizeof, which would otherwise see only this small object.
        return (object.__sizeof__(self) + self.lengths.nbytes + self.tokens.nbytes + self.ends.nbytes
                + self.probes.nbytes + (self.arrivals_s.nbytes if self.arrivals_s is not None else 0))

    def sequences(self) -> list[Sequence]:
        """Every request's compact prompt as a ``Sequence``, in arrival order. A freed sequence can be
        allocated again, in any manager, so a process builds them once for all the replays it runs."""
        ends = [0, *self.ends.tolist()]
        return [Sequence(self.tokens[ends[i]:ends[i + 1]], COMPACT_BLOCK_SIZE) for i in range(len(self.lengths))]

    def unit_probes(self) -> list[list]:
        """Every request's units' probe keys (``probes``), a list per request in arrival order."""
        ends = np.cumsum(-(-self.lengths // self.block_size)).tolist()
        probes = self.probes.tolist()
        return [probes[start:end] for start, end in zip([0, *ends], ends)]


class ReplayClock:
    """The replay's clock for the residency metrics (kvlab.blocks.events): the current request's
    arrival time in seconds, set by ``replay_sequential``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay_sequential(compact: CompactTrace, sequences: list[Sequence], manager: BlockManager, bar,
                      clock: ReplayClock | None = None, doctor=None, probes: list | None = None) -> dict:
    """Replay ``compact.sequences()`` on ``manager`` (block size ``COMPACT_BLOCK_SIZE``, empty); ``bar`` is a
    tqdm bar (or disabled); ``clock``, if given, follows the requests' arrival times; ``doctor`` (a
    ``kvlab.studies.doctor.HitDoctor`` of ``manager`` at the real block size), if given, hears of every prompt,
    with its units' ``probes`` (``compact.unit_probes()``). With an offload tier, the tier hits are counted
    apart from the GPU's (``tier_hit_blocks``) and the copies ``allocate`` returns are dropped (nothing applies
    them: no K/V is held)."""
    needed = (-(-compact.lengths // compact.block_size)).tolist()  # blocks per prompt, as with the real tokens
    arrivals = compact.arrivals_s.tolist() if clock is not None else None
    lengths = compact.lengths.tolist() if doctor is not None else None
    pool = manager.num_blocks
    skipped = peak = 0
    for i, (blocks, seq) in enumerate(zip(needed, sequences), start=1):
        if blocks > pool:
            skipped += 1
            if doctor is not None:
                doctor.not_admitted(lengths[i - 1])
        else:
            if arrivals is not None:
                clock.now = arrivals[i - 1]
            # Between requests every block is free: a prompt that fits the pool fits now.
            if doctor is None:
                manager.allocate(seq)
            else:
                hit = manager.lookup(seq)
                admitted = manager.allocate(seq, hit=hit)
                doctor.admitted(seq, hit, tier_moves=admitted.tier_moves, num_tokens=lengths[i - 1],
                                probes=probes[i - 1])
            peak = max(peak, pool - manager.num_free_blocks)
            manager.free(seq)
        if i % 256 == 0:
            bar.update(256)
    bar.update(len(needed) % 256)  # the bar ends full
    tier = manager.tier_stats
    gpu_hits, tier_hits = manager.stats.hit_blocks, tier.tier_hit_blocks if tier is not None else 0
    hit_blocks = gpu_hits + tier_hits
    return {"requests": len(needed) - skipped, "requests_skipped": skipped, "requests_dropped_mid_decode": 0,
            "hit_tokens": hit_blocks * compact.block_size, "hit_blocks": hit_blocks, "peak_blocks_used": peak,
            "gpu_hit_blocks": gpu_hits, "tier_hit_blocks": tier_hits,
            "offloaded_blocks": tier.offloaded_blocks if tier is not None else 0}


#: Prompt-length buckets of ``unit_hit_rates`` (tokens; the last is open): below one 528-token block, then wider.
LENGTH_BUCKETS = (0, 528, 2048, 8192)


def unit_hit_rates(trace="mooncake_synthetic", *, configs=((528, None), (528, 16), (16, None)),
                   capacity_tokens: int = 1 << 20, window: int = 1024, limit: int | None = None) -> pd.DataFrame:
    """Prefix-cache hit rate by prompt length for each ``(block_size, prefix_match_unit)`` of ``configs``
    (None: whole blocks), replaying ``trace``'s real prompt tokens one request at a time (lookup, allocate,
    free) on an LRU pool of ``capacity_tokens`` tokens. The default configs are vLLM issue #40696's: a 528-token
    block (a hybrid model's page), the same block matched at 16 tokens (vLLM's ``hash_block_size``, kvlab's
    ``prefix_match_unit``), and 16-token blocks, the ceiling. A ``block_size`` of two sizes, ``(F, W)``, is a
    hybrid model: a full-attention group of F-token blocks and a sliding-window group (``window`` tokens) of
    W-token blocks (``group_block_sizes``), hashed at their greatest common divisor, with a pool of
    ``capacity_tokens`` in each group. One row per config and bucket (``LENGTH_BUCKETS``): requests, prompt
    tokens, hit tokens, hit rate in percent; ``config`` names it, and ``prefix_match_unit`` is the step its hits
    come in (for a hybrid model with whole blocks, the least common multiple of its block sizes). Compact
    prompts (``replay_sequential``) cannot stand in here: a partial block's hit depends on its tokens."""
    frame = load_trace(trace, limit)
    frame = frame.iloc[np.argsort(frame["timestamp"].to_numpy(), kind="stable")]
    prompts, lengths = PromptTokens(frame), frame["input_length"].to_numpy(np.int64)
    bucket = np.searchsorted(LENGTH_BUCKETS, lengths, side="right") - 1
    rows = []
    for block_size, unit in configs:
        if isinstance(block_size, tuple):
            manager = HybridBlockManager(sum(capacity_tokens // size for size in block_size), math.gcd(*block_size),
                                         groups=[FullAttentionSpec(), SlidingWindowSpec(window)],
                                         group_block_sizes=block_size, prefix_match_unit=unit)
            config = f"hybrid: full attention in {block_size[0]}, window {window} in {block_size[1]}"
            step = unit or math.lcm(*block_size)
        else:
            manager = BlockManager(max(1, capacity_tokens // block_size), block_size, prefix_match_unit=unit)
            config, step = f"blocks of {block_size}", unit or block_size
        config += f", unit {unit}" if unit else ""
        hit = np.zeros(len(frame), dtype=np.int64)
        for i in range(len(frame)):
            seq = Sequence(prompts[i], manager.block_size)
            if manager.can_allocate(seq).name == "NEVER":  # longer than the pool: computed elsewhere, no hit
                continue
            hit[i] = manager.allocate(seq).num_cached_tokens
            manager.free(seq)
        for b, low in enumerate(LENGTH_BUCKETS):
            chosen = bucket == b
            high = LENGTH_BUCKETS[b + 1] if b + 1 < len(LENGTH_BUCKETS) else None
            tokens = int(lengths[chosen].sum())
            rows.append(dict(config=config, block_size=block_size, prefix_match_unit=step,
                             prompt_tokens=f"{low}-{high - 1}" if high else f">={low}", requests=int(chosen.sum()),
                             queried_tokens=tokens, hit_tokens=int(hit[chosen].sum()),
                             hit_rate=round(100 * hit[chosen].sum() / tokens, 2) if tokens else float("nan")))
    return pd.DataFrame(rows)
