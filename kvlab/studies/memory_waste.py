"""Where KV-cache memory goes under contiguous reservation versus paging (the vLLM paper's Figure 2).

Schemes (Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023, section 2.3 and Figure 2):
- contiguous, as in Orca: each request reserves one contiguous range up front, of ``max_len`` slots
  (Max), of its prompt plus its output length rounded up to a power of two (Pow2: the paper's "over-reserves
  the space for outputs by at most 2x", section 6.1), or of exactly its final length (Oracle).
  Ranges come from a first-fit allocator over one address space of ``budget_tokens`` slots.
- paged, as in vLLM: blocks of ``block_size`` slots, taken one at a time as a request grows; when none
  is free, the youngest running request is preempted (its blocks freed, recomputed later).

Workload: the trace's requests as a permanent backlog, in trace order (timestamps ignored, so memory is
the only limit): the engine admits from the head of the queue while the head fits (no skipping ahead),
every running request stores one token per step, and a request of final length input + output
(output >= 1) frees its memory when it reaches it. Requests longer than ``max_len`` are excluded from
every scheme (counted). Memory is measured after every step while requests are still waiting, and
split into shares of the budget that sum to 1:
    token_states           slots holding K/V of tokens already computed
    reservation            reserved slots that later tokens of the same request will fill
    internal_fragmentation reserved slots that nothing will ever fill (beyond the final length)
    external_fragmentation free slots (free but unusable: the next request does not fit)
Paged admission reserves the prompt plus the first generated token; a paged request's last block is its
only reservation and fragmentation. The simulation is event-driven: between a finish and the next block
boundary every share changes linearly, so the per-step sums are summed in closed form.
"""

import bisect
import heapq
from collections import deque

import numpy as np
import pandas as pd

from kvlab.errors import InvalidArgumentError
from kvlab.studies.traces import check_frame, load_trace
from kvlab.validation import check_int, check_optional_int, is_int

#: Figure 2 of Kwon et al. (SOSP 2023): average share of KV-cache memory holding token states. Cited,
#: not computed; the paper measured OPT-13B-sized requests from its own workloads with max length 2048.
PAPER_TOKEN_STATES = {"Max": 0.204, "Pow2": 0.268, "Oracle": 0.382, "Paged 16": 0.963}
CONTIGUOUS = ("Max", "Pow2", "Oracle")
SHARES = ["token_states", "reservation", "internal_fragmentation", "external_fragmentation"]


def reservation(scheme: str, final_len: np.ndarray, max_len: int, prompt_len: np.ndarray) -> np.ndarray:
    """Slots a contiguous scheme reserves for requests of these final and prompt lengths (output >= 1)."""
    if scheme == "Max":
        return np.full_like(final_len, max_len)
    if scheme == "Pow2":  # the prompt exactly, the output rounded up to a power of two (a true 25 reserves 32)
        output = final_len - prompt_len
        return np.minimum(prompt_len + 2 ** np.ceil(np.log2(output)).astype(np.int64), max_len)
    return final_len.copy()


class _FirstFit:
    """Contiguous ranges from one address space: the lowest hole that fits; freed ranges merge."""

    def __init__(self, size: int):
        self.starts, self.sizes = [0], [size]  # holes, sorted by start

    def allocate(self, n: int):
        for i, size in enumerate(self.sizes):
            if size >= n:
                start = self.starts[i]
                if size == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i], self.sizes[i] = start + n, size - n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:  # merge with the hole after
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:     # and with the hole before
            self.sizes[i - 1] += self.sizes.pop(i)
            del self.starts[i]


def simulate(prompt: np.ndarray, final: np.ndarray, scheme: str, budget_tokens: int, max_len: int) -> dict:
    """Shares of ``budget_tokens`` (time-averaged over backlogged steps) for one scheme: ``"Max"``,
    ``"Pow2"``, ``"Oracle"`` or ``"Paged <block size>"``."""
    paged = scheme.startswith("Paged ")
    block = int(scheme.split()[1]) if paged else 0
    reserve = None if paged else reservation(scheme, final, max_len, prompt)
    total_blocks = budget_tokens // block if paged else 0
    space = None if paged else _FirstFit(budget_tokens)
    free_blocks = total_blocks
    queue, progress = deque(range(len(prompt))), prompt.copy()  # progress: tokens computed so far
    running: dict[int, list] = {}  # request -> [admit step, tokens then, slots held, start, admission number]
    events: list = []              # (step, kind, request, admission number): 0 = finish, 1 = needs a block
    # Aggregates over running requests, constant between events: sum of tokens is base + count * step.
    count = base = allocated = useful = 0  # useful = sum of min(allocated, final)
    now, admitted, sums = 0, 0, dict.fromkeys(SHARES + ["requests", "steps"], 0.0)

    def take(r, slots):
        nonlocal count, base, allocated, useful
        count, base = count + 1, base + int(progress[r]) - now
        allocated, useful = allocated + slots, useful + min(slots, int(final[r]))

    def drop(r):
        nonlocal count, base, allocated, useful, free_blocks
        t0, c0, slots, start, _ = running.pop(r)
        count, base = count - 1, base - (c0 - t0)
        allocated, useful = allocated - slots, useful - min(slots, int(final[r]))
        progress[r] = c0 + now - t0
        if paged:
            free_blocks += slots // block
        else:
            space.free(start, slots)

    while True:
        while events and events[0][0] == now:                 # finishes, then growth of the running
            _, kind, r, number = heapq.heappop(events)
            if r not in running or running[r][4] != number:
                continue
            if kind == 0:
                drop(r)
                continue
            while free_blocks == 0:                            # no block: preempt the youngest
                victim = max(running, key=lambda q: running[q][4])
                drop(victim)
                queue.appendleft(victim)
                if victim == r:
                    break
            if r in running:
                free_blocks -= 1
                old = running[r][2]
                running[r][2] = old + block
                allocated += block
                useful += min(old + block, int(final[r])) - min(old, int(final[r]))
                if old + block < final[r]:
                    heapq.heappush(events, (now + block, 1, r, number))
        while queue:                                           # admit from the head while it fits
            r = queue[0]
            if paged:
                slots = -(-(int(progress[r]) + 1) // block) * block
                if slots // block > free_blocks:
                    break
                free_blocks -= slots // block
                start = None
            else:
                slots = int(reserve[r])
                start = space.allocate(slots)
                if start is None:
                    break
            queue.popleft()
            take(r, slots)
            admitted += 1
            running[r] = [now, int(progress[r]), slots, start, admitted]
            heapq.heappush(events, (now + int(final[r] - progress[r]), 0, r, admitted))
            if paged and slots < final[r]:
                heapq.heappush(events, (now + slots - int(progress[r]), 1, r, admitted))
        if not queue:
            break                                              # the backlog is gone: stop measuring
        nxt = events[0][0]
        k = nxt - now
        tokens = k * base + count * (now + 1 + nxt) * k // 2  # sum of base + count * j, j = now+1..nxt
        sums["token_states"] += tokens
        sums["reservation"] += k * useful - tokens
        sums["internal_fragmentation"] += k * (allocated - useful)
        sums["external_fragmentation"] += k * (budget_tokens - allocated)
        sums["requests"] += k * count
        sums["steps"] += k
        now = nxt
    steps = max(sums["steps"], 1)
    return {**{s: sums[s] / (steps * budget_tokens) for s in SHARES},
            "concurrent_requests": sums["requests"] / steps, "steps_measured": int(sums["steps"])}


def memory_waste(trace="azure_conv", *, budget_tokens: int = 48_000, max_len: int = 8192,
                 block_sizes=(8, 16, 32), limit: int | None = None) -> pd.DataFrame:
    """One row per scheme (Max, Pow2, Oracle, then Paged b for each block size) with the four shares,
    the mean number of requests running at once, and the paper's token-state share where it has one.
    The default budget, 48,000 slots, is ~23 GiB of fp16 KV for a 7B model (512 KiB per token:
    2 x 32 layers x 4096 x 2 B): what a 40 GB GPU keeps after 13.5 GB of weights and some activations."""
    limit = check_optional_int("limit", limit, 1)
    frame = trace.head(limit) if isinstance(trace, pd.DataFrame) else load_trace(trace, limit=limit)
    check_frame(frame, timestamps=False)
    max_len = check_int("max_len", max_len, 1)
    budget_tokens = check_int("budget_tokens", budget_tokens, max_len)
    for b in block_sizes:
        # A request of max_len tokens must fit the pool's whole blocks, or the backlog could stall.
        if not is_int(b) or not 1 <= b or (budget_tokens // b) * b < max_len:
            raise InvalidArgumentError(f"block sizes must be ints >= 1 whose whole blocks in the budget hold "
                                       f"max_len={max_len} tokens, got {b!r}")
    prompt = frame["input_length"].to_numpy(np.int64)
    final = prompt + np.maximum(frame["output_length"].to_numpy(np.int64), 1)
    keep = final <= max_len
    rows = []
    for scheme in [*CONTIGUOUS, *(f"Paged {b}" for b in block_sizes)]:
        row = {"scheme": scheme, **simulate(prompt[keep], final[keep], scheme, budget_tokens, max_len)}
        row.update(requests=int(keep.sum()), requests_excluded=int((~keep).sum()),
                   paper_token_states=PAPER_TOKEN_STATES.get(scheme, np.nan))
        rows.append(row)
    return pd.DataFrame(rows)
