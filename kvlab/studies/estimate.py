"""How long a study will take and how much memory its largest pool needs, told before it starts when a lot.

A study's cost grows with requests x configurations / block size: ``kvlab study --block-size 3`` on the
Mooncake trace replays 48 M blocks per configuration, for more than ten minutes, and its infinite pool
would not even fit a block manager. The costs below were measured on a 2-core CPU (the Mooncake conversation
trace at block sizes 16 to 512, pools of 1,000 blocks to infinite): a sequential replay takes about 20 us
per request plus 1.2 us per full prompt block; an overlap replay, which runs the engine's scheduler over the
whole batch in every step where something changes (``kvlab.studies.overlap``), about 4 ms of CPU per request
plus 15 us per block (measured at block size 512, 3,000 requests, pools of 1,000 and 8,000 blocks);
preparing a trace (once per block size, in this process) about 0.25 us per block; a block manager holds
about 350 bytes per block of its pool. Rough, on a quiet machine (one shared with other jobs takes
longer): enough to tell a 20-second study from a 20-minute one before it starts.
"""

import math

import numpy as np

from kvlab.studies.simulator import MAX_CAPACITY

SECONDS_PER_REQUEST = {"sequential": 20e-6, "overlap": 4e-3}
SECONDS_PER_BLOCK = {"sequential": 1.2e-6, "overlap": 15e-6}
PREPARE_SECONDS_PER_BLOCK = 0.25e-6
BYTES_PER_POOL_BLOCK = 350
#: Worth a word before starting: a minute of waiting, or a pool of 2 GiB.
SLOW_SECONDS, LARGE_POOL_BYTES = 60.0, 2 * 2**30


def estimate(frames, block_sizes, capacities, num_policies: int, mode: str, workers: int) -> tuple[float, int]:
    """``(seconds, bytes)``: the study's rough wall time on ``workers`` parallel workers, and the memory of
    its largest pool (a worker holds one pool at a time). ``frames``: ``(label, trace)`` pairs."""
    finite = [c for c in capacities if c != math.inf]
    infinite = len(finite) < len(capacities)
    replays = len(finite) * num_policies + infinite  # an infinite pool is replayed once (kvlab.studies.study)
    prepare_s = replay_s = 0.0
    largest = 0
    for _, frame in frames:
        prompt = frame["input_length"].to_numpy(np.int64)
        held = prompt + frame["output_length"].to_numpy(np.int64) if mode == "overlap" else prompt  # decode too
        for block_size in block_sizes:
            blocks = int((prompt // block_size).sum())
            prepare_s += blocks * PREPARE_SECONDS_PER_BLOCK
            replay_s += replays * (len(frame) * SECONDS_PER_REQUEST[mode] + blocks * SECONDS_PER_BLOCK[mode])
            # Every block distinct bounds the infinite pool; a block manager holds no more than MAX_CAPACITY.
            pool_bound = min(int((-(-held // block_size)).sum()), MAX_CAPACITY)
            largest = max(largest, pool_bound if infinite else 0, *(min(c, pool_bound) for c in finite))
    parallel = max(1, min(workers, replays * len(frames) * len(block_sizes)))
    return prepare_s + replay_s / parallel, largest * BYTES_PER_POOL_BLOCK


def slow_notice(seconds: float, pool_bytes: int, workers: int) -> str | None:
    """What to tell before a study that takes a minute or more, or a large pool; None for a small one."""
    if seconds < SLOW_SECONDS and pool_bytes < LARGE_POOL_BYTES:
        return None
    memory = (f", and its largest pool needs up to {pool_bytes / 2**30:.1f} GiB of memory in each worker that "
              "replays it" if pool_bytes >= LARGE_POOL_BYTES / 2 else "")
    return (f"kvlab study: this study will take roughly {_duration(seconds)} on {workers} worker"
            f"{'s' if workers != 1 else ''}{memory}. Time and memory grow with requests x configurations / block "
            "size: for a quicker study use a larger block size, fewer capacities or policies, or fewer requests "
            "(on the command line --block-size, --capacity, --policy, --limit; in Python cache_hit_study's "
            "block_sizes, capacities, policies, limit); more workers (--jobs / jobs) shorten the time only.")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} seconds"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"
