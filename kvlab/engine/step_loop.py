"""One engine step: schedule, move blocks, run the model, sample, fork, stop, record.

Requests join (``add``) and leave (finish, ``abort``) only between steps, so a sequence is never freed
between being scheduled and its forward pass (the block manager's ordering rule). If a step fails part way
(an exception, or an interrupt), every unfinished request is aborted and the prefix cache is reset: blocks
that were allocated but never written must not be hit later. The engine is then ready for new requests.
"""

import time

from kvlab.blocks.sequence import Sequence
from kvlab.engine.request import Finish, Request
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampler import Sampler
from kvlab.engine.scheduler import ScheduledStep, Scheduler
from kvlab.engine.step_record import StepRecord


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, eos_token_ids, max_model_len: int):
        self.scheduler, self.runner, self.sampler = scheduler, runner, sampler
        self.manager = scheduler.manager
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.records: list[StepRecord] = []
        self.created = time.perf_counter()
        self._finished_samples = 0  # in the current step

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str, why: str) -> None:
        """Finish an unfinished request's remaining samples with "abort" (an unknown id is ignored)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq, finish in list(zip(request.seqs, request.finishes)):
            if finish is None:
                self._finish(seq, Finish("abort", abort_reason=why))
        self._collect([request])

    def step(self) -> list[Request]:
        """Returns the requests that finished in this step."""
        start = time.perf_counter()
        self._finished_samples = 0
        touched: list[Request] = []
        try:
            step = self.scheduler.schedule()
            if not step.seqs and not step.aborted:
                return []  # nothing queued: no step, no record
            pool = self._pool_state()
            for seq, why in step.aborted:
                touched.append(self._finish(seq, Finish("abort", abort_reason=why)))
            if step.seqs:
                touched += self._append_samples(step, self.runner.run(step))
        except BaseException as error:
            for request_id in list(self.requests):
                self.abort(request_id, f"the engine failed during a step: {error!r}")
            self.manager.reset_prefix_cache()
            raise
        self._record(step, pool, start)
        return self._collect(touched)

    # ---- after the forward pass --------------------------------------------------------------------------
    def _append_samples(self, step: ScheduledStep, logits) -> list[Request]:
        """Sample every sequence's next token (a prompt with n > 1 samples n tokens from its one row and forks
        n - 1 children that share its blocks), append it, and finish the samples that stop."""
        rows, samples, now = [], [], time.perf_counter()
        for row, seq in enumerate(step.seqs):
            request = self.scheduler.owner[seq.seq_id]
            if step.kind == "prefill" and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.metrics.num_cached_prompt_tokens = seq.num_cached_tokens
            if request.needs_fork:  # the prompt's first prefill: every sample draws from this row
                self._fork(request)
                rows += [row] * request.params.n
                samples += [(request, k) for k in range(request.params.n)]
            else:
                rows.append(row)
                samples.append((request, request.seqs.index(seq)))
        tokens = self.sampler(logits[rows], [r.params for r, _ in samples], [r.generators[k] for r, k in samples])
        touched = []
        for (request, k), token in zip(samples, tokens):
            seq = request.seqs[k]
            seq.append_token(token)
            request.metrics.num_generated_tokens += 1
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.perf_counter()
            finish = request.stop_check(seq, self.eos_token_ids, self.max_model_len)
            if finish is not None:
                touched.append(self._finish(seq, finish))
        return touched

    def _fork(self, request: Request) -> None:
        after = request.seqs[0]
        for _ in range(request.params.n - 1):
            child = Sequence([], self.manager.block_size)
            self.manager.fork(request.seqs[0], child)
            self.scheduler.add_fork(after, child)
            request.seqs.append(child)
            after = child

    def _finish(self, seq: Sequence, finish: Finish) -> Request:
        request = self.scheduler.owner[seq.seq_id]
        k = request.seqs.index(seq)
        request.finishes[k] = finish
        if k == 0 and request.needs_fork:  # the prompt never ran: its samples will never exist
            request.finishes[1:] = [finish] * (request.params.n - 1)
        self.scheduler.remove(seq)
        self._finished_samples += 1
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
            step=len(self.records), kind=step.kind if step.seqs else "idle", start_s=start - self.created,
            wall_s=time.perf_counter() - start, num_seqs=len(step.seqs), num_tokens=step.num_new_tokens,
            cached_tokens=step.num_cached_tokens, **pool, preempted=step.num_preempted,
            blocks_swapped_out=moves["swap_out"], blocks_swapped_in=moves["swap_in"], cow_copies=moves["copy"],
            finished=self._finished_samples, aborted=len(step.aborted), waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running), swapped=len(self.scheduler.swapped)))
