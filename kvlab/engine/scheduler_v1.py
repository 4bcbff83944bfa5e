"""V1 scheduling (vLLM V1's ``Scheduler.schedule``): one token budget per step, shared by every sequence.

There are no prefill steps and decode steps. Each step spends ``max_num_batched_tokens`` tokens:

* running sequences first, in order: a decoding sequence takes one token, a partly prefilled prompt the next
  chunk of it (as much as the budget left allows). When the pool is short the newest running sequence not yet
  in the step is preempted (recompute or swap, as in V0), possibly the one asking;
* then, if nothing was preempted, nothing is swapped out and the prefix cache needs no reset, waiting
  sequences are admitted first come first served (or longest cached prefix first: ``waiting_order``,
  kvlab.engine.queue_order): each gets its prefix hits and a first chunk of what the
  budget has left (``allocate(seq, num_new_tokens=k)``), the rest is scheduled by later steps.

So a prompt longer than the budget is prefilled over several steps, and decodes keep running while it is: the
step is one forward pass over prompt chunks and decode tokens together (``ModelRunner.forward``). A sequence
is sampled only at the step that computes its last token; a chunk short of the end produces nothing.

Speculative decoding (``drafter`` set: ``kvlab.engine.speculative``): a decoding sequence also takes up to k
proposed tokens, as draft positions (``append_slots(seq, num_draft_tokens=d)``), within the budget, within what
its ``max_tokens`` and the context leave (a step keeps at most d + 1 tokens), and only when the pool has room
for them as it is: drafts never preempt anyone.

Queues, preemption, swapping and the prefix-cache reset after a failure are the V0 scheduler's
(``kvlab.engine.scheduler``); only ``schedule`` differs.
"""

from collections import deque

from kvlab.blocks.manager import AllocStatus
from kvlab.blocks.sequence import Sequence
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.step import ScheduledStep, StepBuilder


class V1Scheduler(Scheduler):
    scheduling = "v1"  # prompts in chunks: any prompt the pool holds is served
    repeats_plain_decode = True  # a plain decode step repeats as V0's does (Scheduler.steady_decode_steps)
    drafter = None     # a kvlab.engine.speculative.Speculation (SchedulerConfig.build sets it), or None
    max_model_len = None  # set with the drafter: no draft goes past the context (None: no context limit)
    #: A learner's preemption (``kvlab.engine.parts.EngineParts.preempt``), called as ``preemption(manager,
    #: running)`` in steps where its spec applies (``_plain_decodes``), returning ``(scheduled, waiting)``
    #: indices to act on. None: kvlab's loop throughout.
    preemption = None
    #: A learner's step (``kvlab.engine.parts.EngineParts.allocate_tokens``), called as ``token_allocation(
    #: manager, running, waiting, budget, max_num_seqs)`` in steps where the v1_step puzzle's spec applies
    #: (``_token_plan``), returning ``(running_tokens, admitted_tokens)`` to act on, or None where the pool is
    #: short. None: kvlab's loops throughout.
    token_allocation = None

    def schedule(self) -> ScheduledStep:
        if self.prefix_reset_pending and not self.running and not self.swapped:
            self.prefix_reset_pending = not self.manager.reset_prefix_cache()
        step = StepBuilder("mixed", self.sent_tables)
        self._swap_in(step)
        plan = self._token_plan()
        budget = self._schedule_running(step, self.max_num_batched_tokens, plan and plan[0])
        if not step.num_preempted and not self.swapped and not self.prefix_reset_pending:
            with self.waiting_order.admission_pass(self):
                self._schedule_waiting(step, budget, plan and plan[1])
        prefill = any(entry.prefill for entry in step.entries)
        decode = not all(entry.prefill for entry in step.entries)
        return self._note_steady(step.freeze("mixed" if prefill and decode else "decode" if decode else "prefill"))

    def _count(self, step: StepBuilder, seq: Sequence, start: int, drafts: tuple[int, ...] = ()) -> int:
        """Put ``seq`` in the step from position ``start`` (its slots are given: its progress counter is past
        ``start`` now); returns its token count. It prefills while ``start`` is before the end of what it had
        when allocated (``seq.prefill_end``)."""
        return step.add(self.manager, seq, start, prefill=start < seq.prefill_end, drafts=drafts).num_tokens

    def _drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decoding ``seq`` this step: none past what the budget, its ``max_tokens`` or the
        context leave (a step keeps at most drafts + 1 tokens), none the pool has no room for as it is."""
        params = self.owner[seq.seq_id].params
        left = params.max_tokens - seq.num_completion_tokens
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - seq.num_tokens)
        drafts = self.drafter.drafts(seq, min(budget, left) - 1)
        if drafts and not self.manager.can_append_slots(seq, num_new_tokens=1, num_draft_tokens=len(drafts)):
            return ()
        return drafts

    def _token_plan(self) -> tuple[list[int], list[int]] | None:
        """The learner's ``(running_tokens, admitted_tokens)`` where the v1_step puzzle's spec describes this
        step: no drafts, nothing swapped or waiting on a prefix-cache reset, kvlab's own first-come-first-served
        admission, one seat per sequence, no waiting prompt with a prefix hit; None elsewhere (and where the pool
        has no room for the spec's step: ``token_allocation`` says so)."""
        if self.token_allocation is None:
            return None
        candidates = list(self.waiting)[:self.max_num_seqs]
        if (self.drafter is not None or self.swapped or self.prefix_reset_pending
                or self.admission is not None or self.waiting_order.policy != "fcfs"
                or any(self._seats(seq) != 1 for seq in [*self.running, *candidates])
                or any(self.manager.lookup(seq).num_tokens for seq in candidates)):
            return None
        return self.token_allocation(self.manager, list(self.running), candidates, self.max_num_batched_tokens,
                                     self.max_num_seqs)

    def _schedule_running(self, step: StepBuilder, budget: int, planned: list[int] | None = None) -> int:
        """Give running sequences their next tokens while the budget lasts (``planned``: each one's, the
        learner's); returns the budget left."""
        if self.preemption is not None and self._plain_decodes(budget):
            return self._schedule_by_learner(step, budget)
        queue, kept = deque(self.running), []
        while queue and budget:
            seq = queue.popleft()
            start = seq.num_computed_tokens
            num_new = min(seq.num_tokens - start, budget)  # 1 when decoding; a chunk of a partial prompt
            if planned is not None:
                num_new = planned[len(kept)]  # the spec's step: nothing is preempted, so kept counts the entries
            if seq.is_prefilling and not queue and not step.entries:
                num_new = self._chunk_that_fits(seq, num_new)
            decoding = self.drafter is not None and not seq.is_prefilling
            drafts = self._drafts(seq, budget) if decoding else ()
            if self._make_room(seq, queue, step, others=bool(step.entries), num_new_tokens=num_new):
                copies = self.manager.append_slots(seq, num_new_tokens=num_new, num_draft_tokens=len(drafts))
                seq.scheduled_through(copies.num_computed_tokens, len(drafts))
                step.record("copy", copies)
                budget -= self._count(step, seq, start, drafts)
                kept.append(seq)
        self.running = kept + list(queue)  # preempted and aborted sequences are out; unscheduled ones wait
        return budget

    def _plain_decodes(self, budget: int) -> bool:
        """Whether this step is one the preemption puzzle's spec describes: two or more running sequences, each
        decoding one token without drafts within the budget, none waiting, preemption by recompute, and every
        block held by one running sequence alone (a victim frees all it holds)."""
        tables = [self.manager.get_block_table(seq) for seq in self.running]
        return (len(self.running) > 1 and len(self.running) <= budget and not self.waiting and not self.swapped
                and self.drafter is None and self.preemption_mode == "recompute"
                and all(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)
                and all(self.manager.ref_count(block) == 1 for table in tables for block in table))

    def _schedule_by_learner(self, step: StepBuilder, budget: int) -> int:
        """The plain decode step as the learner's ``preemption`` answers (checked against the spec): its victims
        preempted by recompute, the last of them first so that the waiting queue's front is theirs in their
        order, then the others decode one token each."""
        running = list(self.running)
        scheduled, waiting = self.preemption(self.manager, running)
        for index in reversed(waiting):
            self._preempt(running[index], step)
        for index in scheduled:
            seq = running[index]
            start = seq.num_computed_tokens
            copies = self.manager.append_slots(seq, num_new_tokens=1)
            seq.scheduled_through(copies.num_computed_tokens, 0)
            step.record("copy", copies)
            budget -= self._count(step, seq, start)
        self.running = [running[index] for index in scheduled]
        return budget

    def _chunk_that_fits(self, seq: Sequence, num_new: int) -> int:
        """Alone, with no one to preempt, a prompt chunk the pool has no room for is cut to the largest chunk
        that fits, instead of the prompt being aborted: a sliding window releases blocks between steps, so
        smaller chunks hold fewer at once, and ``LLM`` admitted the prompt because one token a step fits
        (``blocks_for_prompt``). Room only shrinks as the chunk grows, so a binary search finds it."""
        fits = lambda k: self.manager.can_append_slots(seq, num_new_tokens=k)  # noqa: E731
        if fits(num_new):
            return num_new
        low, high = 1, num_new  # fits(high) is false; fits(1) may be too (then _make_room aborts, as before)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def _schedule_waiting(self, step: StepBuilder, budget: int, planned: list[int] | None = None) -> None:
        """Admit waiting sequences while the budget and the seats last (``planned``: the tokens of each one to
        admit, the learner's)."""
        seats = sum(map(self._seats, self.running))  # a partial prompt with n samples will become n sequences
        planned = None if planned is None else list(planned)
        while self.waiting and budget:
            seq = self.waiting[0]
            if seats + self._seats(seq) > self.max_num_seqs or planned == []:
                break
            hit = self.manager.lookup(seq)  # once: its hit is passed on as a value
            num_new = min(seq.num_tokens - hit.num_tokens, budget) if planned is None else planned.pop(0)
            status = self._can_allocate(seq, hit, num_new)
            if status is AllocStatus.LATER:
                break
            self.waiting.popleft()
            if status is AllocStatus.NEVER:
                step.aborted.append((seq, self._never_fits(seq)))
                continue
            admitted = self.manager.allocate(seq, num_new_tokens=num_new, hit=hit)
            seq.start_running(admitted)
            step.record_admission(admitted)
            step.num_cached_tokens += seq.num_cached_tokens
            budget -= self._count(step, seq, seq.num_cached_tokens)
            self.running.append(seq)
            seats += self._seats(seq)
