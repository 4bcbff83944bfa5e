"""A simple continuous-batching engine that replays a trace with requests overlapping in time.

Assumptions (each is a parameter of ``EngineModel`` or one line below):
1. One engine with one GPU pool (the ``BlockManager``). Time advances in steps; a step is one forward pass
   over the whole running batch, in which every running sequence stores the K/V of one more token.
2. Requests admitted at the start of a step are prefilled in that same step (mixed prefill + decode, no
   chunking). Step time = ``decode_step_ms`` + ``prefill_ms_per_token`` x the admitted prompts' uncached
   tokens: a cached prefix costs nothing, the decode step is fixed whatever the batch size.
3. A request stores K/V for its prompt plus output_length - 1 tokens (the last sampled token is never fed
   back; output_length 0 counts as 1), finishes at the end of the step that stores the last one, and frees
   its blocks.
4. Arrivals (trace timestamp x ``time_scale``) join a FIFO queue. At the start of a step the engine
   admits from its head while fewer than ``max_num_seqs`` run and ``can_allocate`` says OK. It stops at
   the first LATER (head-of-line blocking, no skipping ahead) and drops a NEVER (a prompt larger than the
   whole pool), counted in ``requests_skipped``.
5. Decode growth: before a step each running sequence gets a slot for the token it stores in that step
   (``append_slots`` with one lookahead slot; the token itself is appended once stored). When no block is
   free, the youngest running sequence is preempted by recompute (``free(preempted=True)``), back to the
   head of the queue with exactly the tokens whose K/V it stored, re-prefilled when readmitted (the token
   it had sampled but not yet stored is sampled again); a step that preempted admits nothing. No
   swapping to CPU.
6. A sequence that needs a block while it runs alone can never finish: its growing sequence outgrew the
   whole pool (the engine does not know output lengths in advance, so it admitted the prompt). It is
   dropped there, its blocks freed, and counted in ``requests_dropped_mid_decode``; its first admission
   still counts in the hit rates and queueing delays (its prompt was really prefilled). ``requests``
   counts the requests that finished: requests + requests_skipped + requests_dropped_mid_decode = the
   trace's requests.
7. Generated tokens get private ids (the traces do not record them), so decode blocks occupy the cache
   but are never hit; a Mooncake prompt hits what earlier *prompts* left behind.
8. Hit rates and queueing delays count each request's first admission; a readmission re-hits its own
   blocks, which is not a prompt-cache effect, and its prefill is reported as ``recomputed_tokens``.

Implementation: sequences decode in lockstep, so between events nothing needs the manager. A sequence's
tokens are appended lazily when it needs a new block (every block_size steps), finishes, or is
preempted; the steps in between are skipped in O(1). Events are kept in a heap keyed by step.
Invariant: a running sequence never holds a token whose K/V is not stored yet; the slot of the token
being stored in the current step is a lookahead slot. ``advance(limit)`` runs only the steps that start
before ``limit`` ms, so a fleet (``kvlab.studies.fleet``) can route each arrival to an engine whose clock
stands at that arrival, knowing nothing of later ones; a single engine knows all its arrivals and runs them
in one call, with the same steps either way.
"""

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from kvlab.blocks.manager import AllocStatus
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError
from kvlab.studies.traces import PRIVATE_RANGE, PRIVATE_TOKEN_BASE, PromptTokens
from kvlab.validation import check_int, check_number

_GROW, _FINISH = 0, 1  # within a step: slots are reserved before it runs, requests finish after


@dataclass(frozen=True)
class EngineModel:
    """Timing and batching knobs of the overlap replay (orders of magnitude for an 8B model on one
    H100-class GPU: ~20 ms per decode step, ~50k prefill tokens/s; assumptions, not measurements)."""
    decode_step_ms: float = 20.0
    prefill_ms_per_token: float = 0.02
    max_num_seqs: int = 256
    time_scale: float = 1.0  # multiplies arrival times: 2.0 halves the request rate

    def __post_init__(self):
        # Finite, and a decode step of at least a microsecond: the clock divides gaps by it and must not
        # overflow (an infinite or NaN clock would never reach the next arrival).
        check_number("decode_step_ms", self.decode_step_ms, 1e-3)
        check_number("prefill_ms_per_token", self.prefill_ms_per_token, 0)
        check_number("time_scale", self.time_scale, 0, min_open=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)


class _Job:
    """One request's progress. ``version`` changes on preemption, which voids its pending events."""
    __slots__ = ("index", "arrival_ms", "prompt_len", "final_len", "seq", "admit_step", "admit_len",
                 "finish_step", "version", "admitted_before")

    def __init__(self, index, arrival_ms, prompt_len, output_len):
        self.index, self.arrival_ms, self.prompt_len = index, arrival_ms, prompt_len
        self.final_len = prompt_len + max(output_len - 1, 0)
        self.seq, self.version, self.admitted_before = None, 0, False


def arrivals(trace, model: EngineModel) -> list[_Job]:
    """The trace's requests in arrival order (ties in file order), with arrival times in ms."""
    with np.errstate(over="ignore"):  # an overflow is reported just below, as an error
        times = trace["timestamp"].to_numpy(dtype=np.float64) * model.time_scale
    if not np.isfinite(times).all():
        raise InvalidArgumentError(f"arrival times overflow: the trace's timestamps x time_scale "
                                   f"{model.time_scale} are not all finite")
    inputs, outputs = trace["input_length"].to_numpy(), trace["output_length"].to_numpy()
    return [_Job(int(i), float(times[i]), int(inputs[i]), int(outputs[i])) for i in np.argsort(times, kind="stable")]


class Engine:
    """One engine replaying the jobs in ``jobs`` (in arrival order; ``push`` adds later ones)."""

    def __init__(self, prompts: PromptTokens, jobs: list[_Job], manager, model: EngineModel, bar):
        self.m, self.bs, self.model, self.bar = manager, manager.block_size, model, bar
        self.prompts, self.arrivals = prompts, jobs
        self.next_arrival = 0
        self.waiting: deque[_Job] = deque()
        self.running: OrderedDict[int, _Job] = OrderedDict()  # admission order: the last is the youngest
        self.events: list[tuple[int, int, int, int]] = []     # (step, phase, job index, job version)
        self.step, self.now_ms = -1, 0.0                        # the last step run, and when the next may start
        self.freed, self.blocked_head = True, None             # can the queue's head be admitted now?
        self.c = dict(hit_tokens=0, hit_blocks=0, skipped=0, dropped=0, preemptions=0, recomputed_tokens=0,
                      prefill_tokens=0, peak=0, batch_steps=0, steps=0)
        self.waiting_tokens = sum(job.prompt_len for job in jobs)  # prompts not admitted yet: a router's signal
        self.queue_ms: list[float] = []
        self.ttft_ms: list[float] = []  # arrival to the end of the step that prefilled it (first admission)
        self.prefilled: list[_Job] = []  # first admissions of the current step

    # ---- token bookkeeping -----------------------------------------------------------------------------
    def _advance(self, job: _Job, length: int) -> None:
        """Append generated tokens (private ids) until the sequence holds ``length`` tokens."""
        seq, base = job.seq, PRIVATE_TOKEN_BASE + job.index * PRIVATE_RANGE
        for position in range(seq.num_tokens, length):
            seq.append_token(base + position)

    def _store_earlier_steps(self, job: _Job) -> None:
        """Append the tokens stored before the current step and seal the blocks they filled. Their slots were
        reserved when stored (prefill or a grow's lookahead), so this takes no block."""
        self._advance(job, job.admit_len + self.step - job.admit_step - 1)
        self.m.append_slots(job.seq)

    def _push(self, step: int, phase: int, job: _Job) -> None:
        heapq.heappush(self.events, (step, phase, job.index, job.version))

    def _pop_due(self, phase: int):
        """Jobs with an event of ``phase`` at the current step, skipping events voided by preemption."""
        while self.events and self.events[0][:2] == (self.step, phase):
            _, _, index, version = heapq.heappop(self.events)
            job = self.running.get(index)
            if job is not None and job.version == version:
                yield job

    # ---- one step ----------------------------------------------------------------------------------------
    def _grow(self) -> bool:
        """Give every sequence that starts a new block this step its slot; returns whether it preempted."""
        preempted = False
        for job in self._pop_due(_GROW):
            # The token this step stores starts a new block: reserve it as a lookahead slot, so that a
            # sequence preempted later in this step still holds only tokens whose K/V is stored.
            self._store_earlier_steps(job)
            while not self.m.can_append_slots(job.seq, 1):
                if len(self.running) == 1:  # alone and still no block: it outgrew the whole pool
                    self._drop(job)
                    break
                victim = next(reversed(self.running.values()))
                self._preempt(victim)
                preempted = True
                if victim is job:
                    break
            else:
                self.m.append_slots(job.seq, 1)
                if self.step + self.bs <= job.finish_step:
                    self._push(self.step + self.bs, _GROW, job)
        return preempted

    def _preempt(self, job: _Job) -> None:
        # Keep the K/V the victim stored in earlier steps (sealing its full blocks), then recompute later.
        self._store_earlier_steps(job)
        self.m.free(job.seq, preempted=True)
        del self.running[job.index]
        job.version += 1
        self.waiting.appendleft(job)
        self.c["preemptions"] += 1
        self.freed = True

    def _drop(self, job: _Job) -> None:
        self.m.free(job.seq)
        del self.running[job.index]
        job.seq = None
        self.c["dropped"] += 1
        self.freed = True
        self.bar.update(1)

    def _admit(self) -> int:
        """Admit from the queue's head (FIFO); returns the uncached prompt tokens to prefill."""
        if not self.waiting or not (self.freed or self.waiting[0] is not self.blocked_head):
            return 0
        self.freed, prefill, c = False, 0, self.c
        while self.waiting and len(self.running) < self.model.max_num_seqs:
            job = self.waiting[0]
            if job.seq is None:
                job.seq = Sequence(self.prompts[job.index], self.bs)
            status = self.m.can_allocate(job.seq)
            if status is AllocStatus.LATER:
                break
            self.waiting.popleft()
            if not job.admitted_before:
                self.waiting_tokens -= job.prompt_len
            if status is AllocStatus.NEVER:
                # A readmission refused for good (possible under a watermark) is a sequence that outgrew
                # the pool mid-decode, not a prompt that never fitted.
                c["dropped" if job.admitted_before else "skipped"] += 1
                job.seq = None
                self.bar.update(1)
                continue
            self.m.allocate(job.seq)
            cached, length = job.seq.num_cached_tokens, job.seq.num_tokens
            prefill += length - cached
            if job.admitted_before:
                c["recomputed_tokens"] += length - cached
            else:
                job.admitted_before = True
                c["hit_tokens"] += cached
                c["hit_blocks"] += cached // self.bs
                self.queue_ms.append(self.now_ms - job.arrival_ms)
                self.prefilled.append(job)
            job.admit_step, job.admit_len = self.step, length
            job.finish_step = self.step + job.final_len - length
            self.running[job.index] = job
            self._push(job.finish_step, _FINISH, job)
            first_grow = self.step + 1 + (-length) % self.bs  # the first step that starts a new block
            if first_grow <= job.finish_step:
                self._push(first_grow, _GROW, job)
        self.blocked_head = self.waiting[0] if self.waiting else None
        return prefill

    def _finish(self) -> None:
        for job in self._pop_due(_FINISH):
            self._advance(job, job.final_len)
            self.m.append_slots(job.seq)  # seals the last full block; its slot was reserved by a grow
            self.m.free(job.seq)
            del self.running[job.index]
            job.seq = None
            self.freed = True
            self.bar.update(1)

    # ---- the clock -----------------------------------------------------------------------------------------
    def _enqueue_arrivals(self) -> None:
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].arrival_ms <= self.now_ms:
            self.waiting.append(self.arrivals[self.next_arrival])
            self.next_arrival += 1

    def _next_step(self):
        """``(step, its start in ms, plain decode steps skipped before it)``: the next step that can change
        anything given the arrivals known now, or None when there is none (done, or idle until a request
        arrives)."""
        if self.step < 0:
            return 0, 0.0, 0
        more_arrivals = self.next_arrival < len(self.arrivals)
        if not self.running:
            if not self.waiting and not more_arrivals:
                return None
            if not self.waiting:  # idle: nothing to do until the next request arrives
                return self.step + 1, max(self.now_ms, self.arrivals[self.next_arrival].arrival_ms), 0
            return self.step + 1, self.now_ms, 0
        candidates = [self.events[0][0]]
        if self.waiting and (self.freed or self.waiting[0] is not self.blocked_head):
            candidates.append(self.step + 1)
        if not self.waiting and more_arrivals:
            gap = self.arrivals[self.next_arrival].arrival_ms - self.now_ms
            candidates.append(self.step + 1 + max(0, math.ceil(gap / self.model.decode_step_ms)))
        skipped = min(candidates) - self.step - 1
        return self.step + 1 + skipped, self.now_ms + skipped * self.model.decode_step_ms, skipped

    def advance(self, limit: float = math.inf) -> float:
        """Run every step that starts before ``limit`` ms; returns when the next one would start (inf: none
        until a request is pushed). Arrivals at ``limit`` or later may be pushed afterwards: no step run so
        far could have seen them (a step enqueues the arrivals up to its start)."""
        c = self.c
        while True:
            upcoming = self._next_step()
            if upcoming is None or upcoming[1] >= limit:
                return math.inf if upcoming is None else upcoming[1]
            self.step, self.now_ms, skipped = upcoming
            c["batch_steps"] += skipped * len(self.running)  # the steps skipped decode the current batch
            c["steps"] += skipped
            self._run_step()

    def in_flight(self) -> int:
        """Requests given to this engine and not finished: running, waiting, or not yet at a step."""
        return len(self.running) + len(self.waiting) + len(self.arrivals) - self.next_arrival

    @property
    def prefill_tokens(self) -> int:
        """Uncached prompt tokens computed so far, recomputations included."""
        return self.c["prefill_tokens"]

    def push(self, job: _Job) -> None:
        """A request routed here; it arrives no earlier than the last one pushed."""
        self.arrivals.append(job)
        self.waiting_tokens += job.prompt_len

    def _run_step(self) -> None:
        model, c = self.model, self.c
        self._enqueue_arrivals()
        prefill = 0 if self._grow() else self._admit()
        c["peak"] = max(c["peak"], self.m.num_blocks - self.m.num_free_blocks)
        c["batch_steps"] += len(self.running)
        c["steps"] += 1
        c["prefill_tokens"] += prefill
        self.now_ms += model.decode_step_ms + model.prefill_ms_per_token * prefill
        if not math.isfinite(self.now_ms):
            raise InvalidArgumentError(f"the simulated clock overflowed ({model}); use smaller times")
        if self.prefilled:
            self.ttft_ms += [self.now_ms - job.arrival_ms for job in self.prefilled]
            self.prefilled.clear()
        self._finish()

    def metrics(self) -> dict:
        c, queue_s = self.c, np.array(self.queue_ms) / 1000.0
        return {
            "requests": len(self.arrivals) - c["skipped"] - c["dropped"], "requests_skipped": c["skipped"],
            "requests_dropped_mid_decode": c["dropped"],
            "hit_tokens": c["hit_tokens"], "hit_blocks": c["hit_blocks"], "peak_blocks_used": c["peak"],
            "preemptions": c["preemptions"],
            "recomputed_tokens": c["recomputed_tokens"], "mean_batch": c["batch_steps"] / max(c["steps"], 1),
            "mean_queue_s": float(queue_s.mean()) if queue_s.size else 0.0,
            "p95_queue_s": float(np.percentile(queue_s, 95)) if queue_s.size else 0.0,
            "makespan_s": self.now_ms / 1000.0,
        }


def replay_overlap(trace, manager, model: EngineModel, bar) -> dict:
    """Run the continuous-batching replay of ``trace`` on ``manager``; ``bar`` is a tqdm bar (or disabled)."""
    engine = Engine(PromptTokens(trace), arrivals(trace, model), manager, model, bar)
    engine.advance()
    return engine.metrics()
