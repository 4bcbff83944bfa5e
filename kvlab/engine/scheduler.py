"""Continuous batching over kvlab's ``BlockManager``: which sequences run in the next step.

Queues: ``waiting`` (new prompts, and sequences preempted by recompute: their prompt plus what they generated
is prefilled again, prefix hits included), ``running`` (blocks in the device pool) and ``swapped`` (blocks in
the CPU pool). Each step is one of two kinds, as in nano-vllm and vLLM v0 without chunked prefill:

* prefill: when nothing is swapped out, waiting sequences are admitted first come first served (or longest
  cached prefix first: ``waiting_order``, kvlab.engine.queue_order) while the token budget, the sequence cap
  and ``can_allocate`` allow (LATER: wait; NEVER: it can never fit, abort it);
* decode: otherwise, swapped sequences come back first, then every running sequence gets a slot for its new
  token with ``append_slots``; when the pool is short the newest running sequence is preempted (recompute:
  freed and re-queued; swap: moved to the CPU pool), possibly the one asking.

Scheduling never frees a sequence that is already in the step (the block manager's ordering rule): victims
are taken from the sequences not yet given a slot. ``schedule`` returns a frozen ``ScheduledStep``
(``kvlab.engine.step``): what each sequence computes, with its tables and slots, read once here.

After a sequence's forward pass failed, blocks it was to write may be in the prefix cache with no K/V in
them. The block manager can forget cached prefixes only when no device block is in use, so until then no
waiting sequence is admitted (nothing can hit those blocks): the running and swapped sequences decode to
the end, then the prefix cache is reset and admissions resume.
"""

from collections import deque

from kvlab.blocks.manager import AllocStatus, BlockManager
from kvlab.blocks.sequence import Sequence, SequenceStatus
from kvlab.engine.queue_order import WaitingOrder
from kvlab.engine.request import Request
from kvlab.engine.step import ScheduledStep, StepBuilder


def pool_text(manager) -> str:
    """The KV pool as one sequence sees it: "8 blocks", or "7 usable blocks of its 8" where the null block of
    a sliding window (or the watermark) is reserved."""
    usable = manager.usable_blocks
    return f"{usable} blocks" if usable == manager.num_blocks else f"{usable} usable blocks of its {manager.num_blocks}"


def too_long_for_the_pool(manager, num_tokens: int, num_new_tokens: int | None) -> str | None:
    """Why a prompt of ``num_tokens`` tokens can never be prefilled here, or None: not even an idle pool with
    nothing cached holds what it needs at once when its first step computes ``num_new_tokens`` tokens (None:
    all), every KV cache group's blocks counted. The scheduler would abort it at admission (``can_allocate``
    says NEVER), so ``LLM`` refuses it up front."""
    needed = manager.blocks_for_prompt(num_tokens, num_new_tokens)
    if needed <= manager.usable_blocks:
        return None
    groups = len(manager.groups)
    across = f" across the model's {groups} KV cache groups" if groups > 1 else ""
    return (f"the prompt has {num_tokens} tokens, which need {needed} blocks of {manager.block_size} at once"
            f"{across}; the KV pool holds only {pool_text(manager)}")


class Scheduler:
    scheduling = "v0"  # whole prompts: a prompt longer than the token budget is refused (kvlab.engine.schedulers)

    def __init__(self, manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.owner: dict[int, Request] = {}      # seq_id -> its request
        self.prefix_reset_pending = False        # admissions wait for the prefix cache reset (see above)
        self.waiting_order = WaitingOrder()      # FCFS; LLM(scheduling_policy="lpm") sets longest prefix first

    def add(self, request: Request) -> None:
        self.owner[request.seqs[0].seq_id] = request
        self.waiting.append(request.seqs[0])

    def add_fork(self, after: Sequence, child: Sequence) -> None:
        """A sample forked after its prompt's prefill: it runs right behind ``after`` (the prompt's sequence or
        the previous fork), so a request's samples stay together in the running order."""
        self.owner[child.seq_id] = self.owner[after.seq_id]
        self.running.insert(self.running.index(after) + 1, child)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its blocks (between steps only)."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
            self.manager.free(seq)
        self.owner.pop(seq.seq_id, None)

    def requeue(self, seq: Sequence) -> None:
        """A prefill sequence that could not run goes back to the front of the waiting queue, its blocks
        freed (after the step's forward pass, so the ordering rule holds); it is prefilled again later."""
        self.running.remove(seq)
        self.manager.free(seq, preempted=True)
        self.waiting.appendleft(seq)

    def forget_unwritten_prefixes(self) -> None:
        """Admit nothing until the prefix cache is reset, as soon as no device block is in use."""
        self.prefix_reset_pending = self.manager.enable_prefix_caching

    def schedule(self) -> ScheduledStep:
        if self.prefix_reset_pending and not self.running and not self.swapped:
            self.prefix_reset_pending = not self.manager.reset_prefix_cache()
        if not self.swapped and not self.prefix_reset_pending:
            step = self._schedule_prefill()
            if step.entries or step.aborted:
                return step.freeze()
        return self._schedule_decode().freeze()

    def _seats(self, seq: Sequence) -> int:
        """Running slots a waiting sequence takes: a prompt with n samples becomes n sequences after prefill."""
        request = self.owner[seq.seq_id]
        return request.params.n if request.needs_fork and seq is request.seqs[0] else 1

    def _make_room(self, seq: Sequence, queue: deque, step: StepBuilder, *, others: bool,
                   num_new_tokens: int | None = None) -> bool:
        """Preempt the newest sequences still in ``queue`` until ``seq`` can take slots for its next tokens;
        with none left, preempt ``seq`` itself if ``others`` run in this step, else abort it (alone in the
        pool and still no room: it can never grow here). True when ``seq`` can grow."""
        while not self.manager.can_append_slots(seq, num_new_tokens=num_new_tokens):
            if queue:
                self._preempt(queue.pop(), step)
            elif others:
                self._preempt(seq, step)
                return False
            else:
                step.aborted.append((seq, f"grew to {seq.num_tokens} tokens, more than the KV pool holds for one "
                                          f"sequence ({pool_text(self.manager)})"))
                return False
        return True

    def _never_fits(self, seq: Sequence) -> str:
        """Why a sequence is aborted when ``can_allocate`` says NEVER: its prompt (or a preempted sequence's
        prompt and output, recomputed) needs more blocks at once than the pool gives one sequence. ``LLM``
        refuses prompts that never fit up front (``too_long_for_the_pool``); this is for the rest."""
        return (f"{seq.num_tokens} tokens need more blocks at once than the KV pool holds for one sequence "
                f"({pool_text(self.manager)})")

    def _schedule_prefill(self) -> StepBuilder:
        step = StepBuilder("prefill")
        with self.waiting_order.admission_pass(self):
            self._admit_waiting(step)
        self.running.extend(step.seqs)
        return step

    def _admit_waiting(self, step: StepBuilder) -> None:
        seats, tokens = len(self.running), 0
        while self.waiting:
            seq = self.waiting[0]
            if seats + self._seats(seq) > self.max_num_seqs:
                break
            # Budgeted on all its tokens (hits are known only once allocated, and an allocated prompt must run).
            # A sequence over the budget on its own is a recompute that grew while decoding: it runs alone.
            if tokens + seq.num_tokens > self.max_num_batched_tokens and step.entries:
                break
            status = self.manager.can_allocate(seq)
            if status is AllocStatus.LATER:
                break
            self.waiting.popleft()
            if status is AllocStatus.NEVER:
                step.aborted.append((seq, self._never_fits(seq)))
                continue
            self.manager.allocate(seq)
            step.add(self.manager, seq, seq.num_cached_tokens, prefill=True)
            step.num_cached_tokens += seq.num_cached_tokens
            seats += self._seats(seq)
            tokens += seq.num_tokens

    def _schedule_decode(self) -> StepBuilder:
        step = StepBuilder("decode")
        self._swap_in(step)
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            if self._make_room(seq, queue, step, others=bool(step.entries)):
                step.record(self.manager, "copy", self.manager.append_slots(seq))
                step.add(self.manager, seq, seq.num_tokens - 1, prefill=False)
        self.running = step.seqs  # preempted and aborted sequences are out
        return step

    def _swap_in(self, step: StepBuilder) -> None:
        """Bring swapped sequences back, oldest first, while the pool keeps a block of headroom per running
        sequence (so the decode below rarely has to push out what just came in)."""
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            blocks = len(self.manager.get_block_table(seq))
            if (self.manager.can_swap_in(seq) is not AllocStatus.OK
                    or self.manager.num_free_blocks - blocks < len(self.running)):
                break
            step.record(self.manager, "swap_in", self.manager.swap_in(seq))
            self.running.append(self.swapped.popleft())

    def _preempt(self, seq: Sequence, step: StepBuilder) -> None:
        if self.preemption_mode == "swap" and self.manager.can_swap_out(seq) is AllocStatus.OK:
            step.record(self.manager, "swap_out", self.manager.swap_out(seq))
            self.swapped.appendleft(seq)
        else:  # recompute (also the fallback when the CPU pool is full)
            self.manager.free(seq, preempted=True)
            self.waiting.appendleft(seq)
        self.owner[seq.seq_id].metrics.num_preemptions += 1
        step.preempted.append(seq)
