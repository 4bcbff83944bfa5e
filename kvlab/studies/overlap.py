"""The overlap replay: a trace's requests overlapping in time, scheduled by the serving engine's own scheduler
with a cost model in place of the model.

The scheduling policy is the engine's, not a copy of it: ``EngineModel.scheduler`` names a class in
``kvlab.engine.schedulers.SCHEDULERS`` (default "v1", what ``LLM`` runs; or pass a ``Scheduler`` subclass),
built as ``LLM`` builds it on the replay's ``BlockManager``, and every step is its ``schedule()``: admission,
head-of-line blocking, chunked prefill, victim choice and recompute are decided there. What the engine's
model runner and sampler do is replaced by a cost model (each assumption is a parameter of ``EngineModel``
or one line below):

1. Time: a step takes ``decode_step_ms`` + ``prefill_ms_per_token`` x the prompt (or recomputed) tokens it
   computes, after prefix hits: a cached prefix costs nothing, the decode part is fixed whatever the batch;
   with an offload tier, + ``tier_ms_per_block`` x the blocks it promotes from the tier (copies not
   overlapped with compute; offloads are write-backs off the critical path and cost nothing); with
   speculative decoding, + ``draft_ms_per_token`` x the drafts it verifies.
2. Sampling: every sequence whose step computes its last token gets one generated token, with a private id
   (the traces do not record them, so decode blocks occupy the cache but are never hit; a Mooncake prompt
   hits what earlier *prompts* left behind). A request stops after max(output_length, 1) tokens, as
   ``SamplingParams(max_tokens=output_length, ignore_eos=True)``: it stores the K/V of its prompt plus
   output_length - 1 tokens, and its blocks are freed after the step that samples its last token.
   Speculative decoding (``EngineModel.speculative_config``): the scheduler gives a decoding sequence the
   drafts of ``EngineModel.draft_acceptance_rate``'s model (``kvlab.studies.engine_model.StatedAcceptance``),
   and the step keeps the leading drafts that are the tokens the replay generates there, plus one token
   after them, as the engine's greedy verification does (``accept_drafts`` rolls the rest back). The
   metrics then also count ``draft_tokens`` (verified) and ``accepted_draft_tokens``.
3. Arrivals (trace timestamp x ``time_scale``) join the scheduler's waiting queue at the first step that
   starts at or after them (``scheduler.add``, as ``LLM.add_request``); with nothing running or waiting the
   clock jumps to the next arrival. Preemption is by recompute (no CPU pool).
4. The scheduler aborts a request that can never run in this pool (``can_allocate`` says NEVER, or it needs
   a block while nothing is left to preempt). Before its first admission it counts in ``requests_skipped``
   (its prompt never fits), after it in ``requests_dropped_mid_decode`` (it outgrew the pool while decoding;
   its first admission still counts in the hit rates and queueing delays). ``requests`` counts the requests
   that finished: requests + requests_skipped + requests_dropped_mid_decode = the trace's requests.
5. Hit rates and queueing delays (arrival to the start of the step that admits it) count each request's
   first admission; ``recomputed_tokens`` are prefill tokens a request computes again after a preemption
   (its own blocks it hits again are not counted: they are not a prompt-cache effect, and cost nothing);
   ``ttft_ms``: arrival to the end of the step that samples its first token.

``Engine(..., record_decisions=True)`` keeps each step's decision (``kvlab.engine.decisions.StepDecision``,
requests named by their trace row) in ``engine.decisions``, the record ``LLM(record_decisions=True)`` keeps:
a replay and an engine run of the same workload decide the same steps.

Speed: between two steps where something changes, the built-in schedulers run plain decode steps that are
all alike; the scheduler says how many (``Scheduler.steady_decode_steps``) and ``kvlab.studies.fast_forward``
runs those in one go, with the same effect on the block manager.
``advance(limit)`` runs only the steps that start before ``limit`` ms, so a fleet (``kvlab.studies.fleet``)
can route each arrival to an engine whose clock stands at that arrival, knowing nothing of later ones.
"""

import math

import numpy as np

from kvlab.blocks.sequence import Sequence
from kvlab.engine.decisions import StepDecision, decide
from kvlab.engine.request import Request, RequestMetrics
from kvlab.engine.sampling_params import SamplingParams
from kvlab.errors import InvalidArgumentError
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.doctor import DoctorView, HitDoctor
from kvlab.studies.fast_forward import CostModelView, generated_token, plain_decode_steps, run_plain_decode_steps
from kvlab.studies.traces import PromptTokens


class _Job:
    """One request of the trace and what the replay counts for it. ``request`` is None until it arrives at
    a step and again once it finished or was aborted (its tokens are freed then)."""
    __slots__ = ("index", "arrival_ms", "prompt_len", "max_tokens", "request", "admitted", "computed")

    def __init__(self, index, arrival_ms, prompt_len, output_len):
        self.index, self.arrival_ms, self.prompt_len = index, arrival_ms, prompt_len
        self.max_tokens = max(output_len, 1)
        self.request, self.admitted, self.computed = None, False, 0  # computed: the furthest position reached


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

    def __init__(self, prompts: PromptTokens, jobs: list[_Job], manager, model: EngineModel, bar, *,
                 record_decisions: bool = False, doctor: HitDoctor | None = None):
        self.m, self.bs, self.model, self.bar = manager, manager.block_size, model, bar
        self.doctor = doctor  # told of every admission and free (kvlab.studies.doctor), or None
        self.scheduler = model.make_scheduler(CostModelView(DoctorView(manager, doctor) if doctor else manager))
        self.prompts, self.arrivals = prompts, jobs
        self.next_arrival = 0
        self.jobs: dict[int, _Job] = {}  # seq_id -> its job, while the scheduler holds it
        self.decisions: list[StepDecision] | None = [] if record_decisions else None
        self.fast_forward = not record_decisions  # a decision is recorded for every step, so none is skipped
        # The clock: the next step starts at base_ms + the steps, prefill tokens, promoted blocks and drafts
        # since (integers, so a run of steps taken in one go ends at exactly the time it would have one by one).
        self.base_ms, self.steps_since, self.prefill_since, self.promoted_since, self.drafts_since = 0.0, 0, 0, 0, 0
        self.drafter = getattr(self.scheduler, "drafter", None)  # V1 only (EngineModel.speculative_config)
        self.c = dict(hit_tokens=0, hit_blocks=0, skipped=0, dropped=0, preemptions=0, recomputed_tokens=0,
                      prefill_tokens=0, peak=0, batch_steps=0, steps=0, draft_tokens=0, accepted_draft_tokens=0)
        self.waiting_tokens = sum(job.prompt_len for job in jobs)  # prompts not admitted yet: a router's signal
        self.queue_ms: list[float] = []
        self.ttft_ms: list[float] = []

    @property
    def now_ms(self) -> float:
        """When the next step starts (once every step so far ran)."""
        return self.start_after(0)

    def start_after(self, plain_steps: int) -> float:
        """When a step would start after the next one and then ``plain_steps - 1`` more plain decode steps."""
        model = self.model
        return (self.base_ms + model.decode_step_ms * (self.steps_since + plain_steps)
                + model.prefill_ms_per_token * self.prefill_since + model.tier_ms_per_block * self.promoted_since
                + model.draft_ms_per_token * self.drafts_since)

    def count_plain_decode_steps(self, steps: int, batch: int) -> None:
        """``steps`` plain decode steps of ``batch`` sequences ran (``kvlab.studies.fast_forward``)."""
        self.c["batch_steps"] += steps * batch
        self.c["steps"] += steps
        self.steps_since += steps

    # ---- the clock -----------------------------------------------------------------------------------------
    def _enqueue_arrivals(self) -> None:
        now = self.now_ms
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].arrival_ms <= now:
            job = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True)
            seq = Sequence(self.prompts[job.index], self.bs)
            job.request = Request(str(job.index), None, [], params, [seq], [None],
                                  RequestMetrics(job.arrival_ms / 1000.0, job.prompt_len), [None])
            self.jobs[seq.seq_id] = job
            self.scheduler.add(job.request)

    def _busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.scheduler.swapped)

    def advance(self, limit: float = math.inf) -> float:
        """Run every step that starts before ``limit`` ms; returns when the next one would start (inf: none
        until a request is pushed). Arrivals at ``limit`` or later may be pushed afterwards: no step run so
        far could have seen them (a step enqueues the arrivals up to its start)."""
        while True:
            if not self._busy():
                if self.next_arrival == len(self.arrivals):
                    return math.inf
                arrival = self.arrivals[self.next_arrival].arrival_ms
                if arrival > self.now_ms:  # idle: nothing to do until the next request arrives
                    self.base_ms, self.steps_since, self.prefill_since, self.promoted_since = arrival, 0, 0, 0
                    self.drafts_since = 0
            if self.now_ms >= limit:
                return self.now_ms
            self._enqueue_arrivals()  # those up to the next step's start
            skipped = plain_decode_steps(self, limit) if self.fast_forward else 0
            if skipped:
                run_plain_decode_steps(self, skipped)
            else:
                self._run_step()

    def in_flight(self) -> int:
        """Requests given to this engine and not finished: running, waiting, or not yet at a step."""
        scheduler = self.scheduler
        return (len(scheduler.running) + len(scheduler.waiting) + len(scheduler.swapped)
                + len(self.arrivals) - self.next_arrival)

    @property
    def prefill_tokens(self) -> int:
        """Uncached prompt tokens computed so far, recomputations included."""
        return self.c["prefill_tokens"]

    def push(self, job: _Job) -> None:
        """A request routed here; it arrives no earlier than the last one pushed."""
        self.arrivals.append(job)
        self.waiting_tokens += job.prompt_len

    # ---- one step ------------------------------------------------------------------------------------------
    def _run_step(self) -> None:
        """Schedule and cost one step (its arrivals are in the queue)."""
        c, scheduler = self.c, self.scheduler
        start_ms = self.now_ms
        step = scheduler.schedule()
        if not step.entries and not step.aborted:  # a learner's scheduler that would stall the replay
            raise InvalidArgumentError(f"scheduler {type(scheduler).__name__} scheduled nothing although "
                                       f"{len(scheduler.running)} sequences run and {len(scheduler.waiting)} wait")
        if self.decisions is not None and (step.entries or step.aborted):
            self.decisions.append(decide(len(self.decisions), step, scheduler))
        c["peak"] = max(c["peak"], self.m.num_blocks - self.m.num_free_blocks)
        for seq, _ in step.aborted:
            self._abort(self.jobs[seq.seq_id])
        c["preemptions"] += len(step.preempted)
        prefill = 0
        for entry in step.entries:
            job = self.jobs[entry.seq.seq_id]
            if entry.prefill:
                prefill += entry.num_tokens
                if not job.admitted:
                    self._first_admission(job, entry.seq, start_ms)
                c["recomputed_tokens"] += max(0, min(entry.end, job.computed) - entry.start)
            job.computed = max(job.computed, entry.end - entry.num_draft_tokens)  # drafts: once accepted
        if not step.entries:
            return
        c["batch_steps"] += len(step.entries)
        c["steps"] += 1
        c["prefill_tokens"] += prefill
        self.steps_since += 1
        self.prefill_since += prefill
        self.promoted_since += step.moves.counts["promote"]  # blocks copied in from an offload tier
        if self.drafter is not None:
            self.drafts_since += sum(entry.num_draft_tokens for entry in step.entries)
        if not math.isfinite(self.now_ms):
            raise InvalidArgumentError(f"the simulated clock overflowed ({self.model}); use smaller times")
        self._sample(step)

    def _first_admission(self, job: _Job, seq: Sequence, start_ms: float) -> None:
        c, cached = self.c, seq.num_cached_tokens
        job.admitted = True
        self.waiting_tokens -= job.prompt_len
        c["hit_tokens"] += cached
        c["hit_blocks"] += cached // self.bs
        self.queue_ms.append(start_ms - job.arrival_ms)

    def _sample(self, step) -> None:
        """Give every sequence the step samples its next token, after the drafts it accepts, if any."""
        for entry in step.entries:
            if not entry.samples:  # a prompt chunk short of the end
                continue
            seq, job = entry.seq, self.jobs[entry.seq.seq_id]
            if seq.num_completion_tokens == 0:
                self.ttft_ms.append(self.now_ms - job.arrival_ms)
            if entry.num_draft_tokens:
                self._verify(entry, job)
            else:
                seq.append_token(generated_token(job.index, seq.num_tokens))
            if seq.num_completion_tokens >= job.max_tokens:
                self._finish(job)

    def _verify(self, entry, job: _Job) -> None:
        """The engine's greedy verification (``kvlab.engine.step_loop``), with the replay's tokens as the
        target's: the leading drafts that are the tokens generated there are kept, then one more token. The
        scheduler's drafts stop before ``max_tokens`` (``V1Scheduler._drafts``), so all of them are appended."""
        seq, drafts = entry.seq, entry.draft_token_ids
        kept = 0
        while kept < len(drafts) and drafts[kept] == generated_token(job.index, seq.num_tokens + kept):
            kept += 1
        for _ in range(kept + 1):
            seq.append_token(generated_token(job.index, seq.num_tokens))
        seq.scheduled_through(self.m.accept_drafts(seq, kept))  # the scheduler's write, as step_loop's
        job.computed = max(job.computed, seq.num_computed_tokens)
        self.c["draft_tokens"] += len(drafts)
        self.c["accepted_draft_tokens"] += kept

    def _finish(self, job: _Job) -> None:
        seq = job.request.seqs[0]
        if self.drafter is not None:  # as the engine's step loop: its draft control forgets the sequence
            self.drafter.finished(seq)
        self.scheduler.remove(seq)
        del self.jobs[seq.seq_id]
        job.request = None
        self.bar.update(1)

    def _abort(self, job: _Job) -> None:
        if not job.admitted:  # never admitted: its prompt can never be prefilled in this pool
            self.waiting_tokens -= job.prompt_len
            if self.doctor is not None:
                self.doctor.not_admitted(job.prompt_len)
        self.c["dropped" if job.admitted else "skipped"] += 1
        self._finish(job)

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
        } | ({} if self.drafter is None else
             {"draft_tokens": c["draft_tokens"], "accepted_draft_tokens": c["accepted_draft_tokens"]})


def replay_overlap(trace, manager, model: EngineModel, bar, doctor: HitDoctor | None = None) -> dict:
    """Run the continuous-batching replay of ``trace`` on ``manager``; ``bar`` is a tqdm bar (or disabled);
    ``doctor``, if given, hears of every admission and free."""
    engine = Engine(PromptTokens(trace), arrivals(trace, model), manager, model, bar, doctor=doctor)
    engine.advance()
    return engine.metrics()
