"""One record per engine step: what ran, what the pool looked like while it ran, and what it cost."""

from dataclasses import asdict, dataclass

import pandas as pd


@dataclass
class StepRecord:
    step: int
    kind: str              # "prefill", "decode", "mixed" (both, V1 scheduling), or "idle" (only aborts
                           # happened: nothing could run)
    start_s: float         # seconds since the engine was created
    wall_s: float          # scheduling + block moves + forward + sampling
    num_seqs: int          # sequences in the batch
    num_tokens: int        # tokens computed: prefill_tokens + decode_tokens
    prefill_tokens: int    # prompt tokens (or chunks of them) computed, after prefix hits
    decode_tokens: int     # one per sequence past its prefill, plus its draft tokens
    cached_tokens: int     # prompt tokens read from the prefix cache instead of computed
    blocks_used: int       # device pool while the step ran (after scheduling)
    blocks_free: int       # includes free blocks that still hold a cached prefix...
    blocks_cached: int     # ...counted here with the in-use blocks a prefix lookup can hit
    preempted: int         # sequences preempted (recompute or swap) to make room
    blocks_swapped_out: int
    blocks_swapped_in: int
    cow_copies: int        # copy-on-write block copies applied with copy_blocks
    finished: int          # samples that finished (stop, length or abort) after this step
    aborted: int           # samples that can never run in this pool
    waiting: int           # queue lengths after the step
    running: int
    swapped: int
    draft_tokens: int = 0          # speculative decoding: drafts verified in this step (in decode_tokens too)
    accepted_tokens: int = 0       # ...of which the target accepted
    rejected_draft_slots: int = 0  # KV slots written for the rejected ones (overwritten by later steps)


def records_to_dataframe(records: list[StepRecord]) -> pd.DataFrame:
    columns = list(StepRecord.__dataclass_fields__)
    return pd.DataFrame([asdict(r) for r in records], columns=columns)
