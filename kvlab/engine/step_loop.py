"""One engine step: schedule, move blocks, run the model, sample, fork, stop, record.

Requests join (``add``) and leave (finish, ``abort``) only between steps, so a sequence is never freed
between being scheduled and its forward pass (the block manager's ordering rule).

A failure is kept to the request it belongs to: a sequence whose forward pass, sampling, fork or stop check
raises finishes with finish_reason "abort" and the error as its reason, and every other request carries on
as if it had not been there (``kvlab.engine.isolation``). Only a failure no request can be blamed for (in
scheduling, in the step's block moves, or an interrupt) fails the whole step: then every unfinished request
is aborted and the prefix cache is reset (blocks that were allocated but never written must not be hit
later), and the error is raised. Either way the engine is ready for new requests, and the aborted requests
are returned by the next step.
"""

import time

from kvlab.blocks.sequence import Sequence
from kvlab.engine.decisions import StepDecision, decide
from kvlab.engine.isolation import run_forward, sample_rows
from kvlab.engine.request import Finish, Request
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampler import Sampler
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.speculative import accept
from kvlab.engine.step import ScheduledStep, SeqStep
from kvlab.engine.step_record import StepRecord


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, eos_token_ids, max_model_len: int,
                 record_decisions: bool = False, verify=accept):
        self.scheduler, self.runner, self.sampler = scheduler, runner, sampler
        self.verify = verify  # speculative.accept, or a learner's rejection sampling (kvlab.engine.parts)
        self.manager = scheduler.manager
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.finished_between: list[Request] = []  # finished between steps (aborted): the next step returns them
        self.records: list[StepRecord] = []
        # One per record when asked for (kvlab.engine.decisions); None: nothing is built or kept.
        self.decisions: list[StepDecision] | None = [] if record_decisions else None
        self.created = time.perf_counter()
        self._finished_samples = 0  # in the current step
        self._drafts_proposed = self._drafts_accepted = 0  # in the current step (speculative decoding)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str, why: str) -> None:
        """Finish an unfinished request's remaining samples with "abort"; the next ``step`` returns it. An
        unknown or finished id is ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self._abort(request, why)
            self.finished_between += self._collect([request])

    def step(self) -> list[Request]:
        """Returns the requests finished since the last step (aborted), then those that finished in this one."""
        start = time.perf_counter()
        self._finished_samples = self._drafts_proposed = self._drafts_accepted = 0
        earlier, self.finished_between = self.finished_between, []
        try:
            step = self.scheduler.schedule()
            if not step.entries and not step.aborted:
                return earlier  # nothing queued: no step, no record
            decision = None if self.decisions is None else decide(len(self.records), step, self.scheduler)
            pool = self._pool_state()
            touched = [self._finish(seq, Finish("abort", abort_reason=why)) for seq, why in step.aborted]
            if step.entries:
                self.runner.begin_step(step)
                touched += self._run(step)
        except BaseException as error:
            self.finished_between = earlier  # still to be returned, before the requests aborted now
            for request_id in list(self.requests):
                self.abort(request_id, f"the engine failed during a step: {error!r}")
            self.manager.reset_prefix_cache()
            raise
        self._record(step, pool, start)
        if decision is not None:
            self.decisions.append(decision)
        return earlier + self._collect(touched)

    # ---- after the block moves -----------------------------------------------------------------------------
    def _run(self, step: ScheduledStep) -> list[Request]:
        result = run_forward(self.runner, step, self.manager.block_size)
        touched = [self._fail(seq, "the forward pass", error) for seq, error in result.failed]
        for seq in reversed(result.blocked):  # reversed: they go back to the queue's front in step order
            self.scheduler.requeue(seq)
        if result.failed or result.blocked:
            self.scheduler.forget_unwritten_prefixes()
        now = time.perf_counter()
        for entry in result.entries:
            metrics = self.scheduler.owner[entry.seq.seq_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_prompt_tokens = entry.seq.num_cached_tokens
        # Only a sequence whose every token now has K/V samples: a prompt chunk short of the end produces none.
        # Its logits start at row `first` (a sequence with d drafts has d + 1 rows: runner.forward).
        ready, drafted, first = [], [], 0
        for entry in result.entries:
            if entry.num_draft_tokens:
                drafted.append((first, entry))
            elif entry.samples:
                ready.append((first, entry.seq))
            first += 1 + entry.num_draft_tokens
        if ready:
            touched += self._append_samples(ready, result.logits)
        for first, entry in drafted:
            touched += self._verify(entry, result.logits[first:first + 1 + entry.num_draft_tokens])
        return touched

    def _verify(self, entry: SeqStep, logits) -> list[Request]:
        """Keep the run of ``entry``'s drafts the target accepts and its own next token
        (``kvlab.engine.speculative.accept``), appended one by one with the stop check after each, so a stop
        inside the run ends it there; then the block manager keeps the kept drafts' K/V and rolls back past the
        others (``accept_drafts``). Returns the request if the sample finished."""
        seq, drafts = entry.seq, entry.draft_token_ids
        request = self.scheduler.owner[seq.seq_id]
        generator = request.generators[request.seqs.index(seq)] or self.sampler.generator
        try:
            tokens = self.verify(logits, drafts, request.params, generator)
        except Exception as error:  # noqa: BLE001 - this sequence's failure, kept as its abort reason
            return [self._fail(seq, "sampling", error)]
        finish, appended = None, 0
        try:
            for token in tokens:
                appended += 1
                finish = self._append(request, seq, token)
                if finish is not None:
                    break
        except Exception as error:  # noqa: BLE001 - this sample's failure, kept as its abort reason
            return [self._fail(seq, "the stop check", error)]
        kept = min(appended, len(tokens) - 1)  # drafts kept: the last token appended may be the target's own
        seq.scheduled_through(self.manager.accept_drafts(seq, kept))  # past the rejected drafts
        request.metrics.count_drafts(len(drafts), len(tokens) - 1)
        self._drafts_proposed += len(drafts)
        self._drafts_accepted += len(tokens) - 1
        return [] if finish is None else [self._finish(seq, finish)]

    def _append_samples(self, ready: list[tuple[int, Sequence]], logits) -> list[Request]:
        """Sample the next token of every ``(logits row, sequence)`` in ``ready`` (a prompt with n > 1 samples
        n tokens from its one row and forks n - 1 children that share its blocks), append it, and finish the
        samples that stop."""
        rows, samples, touched = [], [], []
        for row, seq in ready:
            request = self.scheduler.owner[seq.seq_id]
            if request.needs_fork:  # the prompt's first prefill: every sample draws from this row
                try:
                    self._fork(request)
                except Exception as error:  # noqa: BLE001 - this request's failure, kept as its abort reason
                    self._abort(request, f"forking its samples failed: {error!r}")
                    touched.append(request)
                    continue
                rows += [row] * request.params.n
                samples += [(request, k) for k in range(request.params.n)]
            else:
                rows.append(row)
                samples.append((request, request.seqs.index(seq)))
        if not samples:
            return touched
        tokens = sample_rows(self.sampler, logits[rows], [r.params for r, _ in samples],
                             [r.generators[k] for r, k in samples])
        for (request, k), token in zip(samples, tokens):
            seq = request.seqs[k]
            if isinstance(token, Exception):
                touched.append(self._fail(seq, "sampling", token))
                continue
            try:
                finish = self._append(request, seq, token)
            except Exception as error:  # noqa: BLE001 - this sample's failure, kept as its abort reason
                touched.append(self._fail(seq, "the stop check", error))
                continue
            if finish is not None:
                touched.append(self._finish(seq, finish))
        return touched

    def _append(self, request: Request, seq: Sequence, token: int) -> Finish | None:
        seq.append_token(token)
        request.metrics.num_generated_tokens += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.perf_counter()
        return request.stop_check(seq, self.eos_token_ids, self.max_model_len)

    def _fork(self, request: Request) -> None:
        after = request.seqs[0]
        for _ in range(request.params.n - 1):
            child = Sequence([], self.manager.block_size)
            self.manager.fork(request.seqs[0], child)
            self.scheduler.add_fork(after, child)
            request.seqs.append(child)
            after = child

    # ---- finishing -------------------------------------------------------------------------------------------
    def _fail(self, seq: Sequence, what: str, error: BaseException) -> Request:
        return self._finish(seq, Finish("abort", abort_reason=f"{what} failed for this sequence: {error!r}"))

    def _abort(self, request: Request, why: str) -> None:
        for seq, finish in list(zip(request.seqs, request.finishes)):
            if finish is None:
                self._finish(seq, Finish("abort", abort_reason=why))

    def _finish(self, seq: Sequence, finish: Finish) -> Request:
        request = self.scheduler.owner[seq.seq_id]
        k = request.seqs.index(seq)
        request.finishes[k] = finish
        if k == 0 and request.needs_fork:  # the prompt never ran: its samples will never exist
            request.finishes[1:] = [finish] * (request.params.n - 1)
        self.scheduler.remove(seq)
        self._finished_samples += 1
        # After the engine's own bookkeeping: a proposer is user code (its tokens are still there to learn from).
        drafter = getattr(self.scheduler, "drafter", None)  # V1 scheduling only (kvlab.engine.speculative)
        if drafter is not None:
            drafter.finished(seq)
        return request

    def _collect(self, touched: list[Request]) -> list[Request]:
        finished = []
        for request in dict.fromkeys(touched):  # in order, once each
            if request.finished and self.requests.pop(request.request_id, None) is not None:
                request.metrics.finished_time = time.perf_counter()
                finished.append(request)
        return finished

    # ---- observability -----------------------------------------------------------------------------------
    def _pool_state(self) -> dict:
        free = self.manager.num_free_blocks
        return dict(blocks_used=self.manager.num_blocks - free, blocks_free=free,
                    blocks_cached=self.manager.num_cached_blocks)

    def _record(self, step: ScheduledStep, pool: dict, start: float) -> None:
        moves = step.moves.counts
        self.records.append(StepRecord(
            step=len(self.records), kind=step.kind if step.entries else "idle", start_s=start - self.created,
            wall_s=time.perf_counter() - start, num_seqs=len(step.entries), num_tokens=step.num_new_tokens,
            prefill_tokens=step.num_prefill_tokens, decode_tokens=step.num_decode_tokens,
            cached_tokens=step.num_cached_tokens, **pool, preempted=step.num_preempted,
            blocks_swapped_out=moves["swap_out"], blocks_swapped_in=moves["swap_in"], cow_copies=moves["copy"],
            finished=self._finished_samples, aborted=len(step.aborted), waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running), swapped=len(self.scheduler.swapped),
            draft_tokens=self._drafts_proposed, accepted_tokens=self._drafts_accepted,
            rejected_draft_slots=self._drafts_proposed - self._drafts_accepted))
