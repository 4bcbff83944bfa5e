"""Continuous batching over kvlab's ``KVCacheManager``: which sequences run in the next step. The scheduler owns
its sequences' progress and status (as vLLM V1's does): after each manager call it writes them from what the
call returned (``Sequence.start_running``, ``scheduled_through``, ``stopped``).

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

Steady decode: after a plain decode step (every running sequence decodes one token; nothing is admitted,
preempted, swapped, aborted or copied) the next steps are the same step again until a sequence needs a new
block, as long as nothing joins or leaves in a way that could change admission (``add``, ``remove``).
``steady_decode_steps`` says how many, from the scheduler's own record of its last step, and
``advance_steady_decode`` runs them in one go: the overlap study replays long decode stretches that way
(``kvlab.studies.fast_forward``).
"""

from collections import deque

from kvlab.blocks.manager import AllocStatus, BlockManager, KVCacheManager
from kvlab.blocks.sequence import Sequence, SequenceStatus
from kvlab.engine.queue_order import WaitingOrder
from kvlab.engine.request import Request
from kvlab.engine.step import ScheduledStep, SentTables, StepBuilder
from kvlab.errors import InvalidArgumentError
from kvlab.validation import is_int


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
    # Whether ``steady_decode_steps`` may promise repeated steps. A subclass may decide anything at any step, so
    # it promises nothing unless its own class body sets this again (``__init_subclass__``).
    repeats_plain_decode = True

    #: Called as ``on_blocks_freed(gpu_block_ids, cpu_block_ids)`` with the blocks a sequence's free left
    #: unreferenced (``_free``): the engine drops what it keeps per block beside the pages (a KIVI cache's
    #: windows, ``PagedKVCache.forget_blocks``). None: nothing is kept.
    on_blocks_freed = None

    #: A learner's admission (``kvlab.engine.parts.EngineParts.admit``), called as ``admission(manager, seq,
    #: hit, num_new_tokens, status)`` with kvlab's ``can_allocate`` answer and returning the one to act on.
    #: None: kvlab's answer.
    admission = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.repeats_plain_decode = cls.__dict__.get("repeats_plain_decode", False)

    def __init__(self, manager: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str):
        if isinstance(manager, BlockManager):
            raise InvalidArgumentError("a scheduler writes its sequences' progress itself: give it a KVCacheManager "
                                       "(kvlab.blocks), not a BlockManager, which writes it too")
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
        self._steady = False                     # the last step was plain decode, nothing changed since
        self.sent_tables = SentTables()          # the block tables the runner holds: steps send what changed

    def add(self, request: Request) -> None:
        self.owner[request.seqs[0].seq_id] = request
        # Behind a waiting head that FCFS refused, a newcomer changes nothing: admission stops at the head.
        self._steady = self._steady and bool(self.waiting) and self.waiting_order.policy == "fcfs"
        self.waiting.append(request.seqs[0])

    def add_fork(self, after: Sequence, child: Sequence) -> None:
        """A sample forked after its prompt's prefill: it runs right behind ``after`` (the prompt's sequence or
        the previous fork), so a request's samples stay together in the running order."""
        self.owner[child.seq_id] = self.owner[after.seq_id]
        self.running.insert(self.running.index(after) + 1, child)
        self._steady = False

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its blocks (between steps only)."""
        # A running sequence leaving frees seats, budget and blocks: the rest decode as before unless someone waits.
        self._steady = self._steady and seq in self.running and not self.waiting
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
            self._free(seq)
        self.owner.pop(seq.seq_id, None)

    def requeue(self, seq: Sequence) -> None:
        """A prefill sequence that could not run goes back to the front of the waiting queue, its blocks
        freed (after the step's forward pass, so the ordering rule holds); it is prefilled again later."""
        self.running.remove(seq)
        self._free(seq, preempted=True)
        self.waiting.appendleft(seq)
        self._steady = False

    def _free(self, seq: Sequence, *, preempted: bool = False) -> None:
        """``manager.free``, then ``on_blocks_freed`` with the sequence's blocks nobody references any more (a
        block it shares with a fork, or a cached prefix another sequence holds, stays)."""
        self.sent_tables.forget(seq.seq_id)
        if self.on_blocks_freed is None:
            self.manager.free(seq, preempted=preempted)
            return seq.stopped(preempted)
        on_cpu = self.manager.is_swapped(seq)
        blocks = set(self.manager.get_block_table(seq))
        self.manager.free(seq, preempted=preempted)
        seq.stopped(preempted)
        references = self.manager.cpu_ref_count if on_cpu else self.manager.ref_count
        unreferenced = [block for block in blocks if references(block) == 0]
        self.on_blocks_freed([] if on_cpu else unreferenced, unreferenced if on_cpu else [])

    def forget_unwritten_prefixes(self) -> None:
        """Admit nothing until the prefix cache is reset, as soon as no device block is in use."""
        self.prefix_reset_pending = self.manager.enable_prefix_caching

    def schedule(self) -> ScheduledStep:
        if self.prefix_reset_pending and not self.running and not self.swapped:
            self.prefix_reset_pending = not self.manager.reset_prefix_cache()
        if not self.swapped and not self.prefix_reset_pending:
            step = self._schedule_prefill()
            if step.entries or step.aborted:
                return self._note_steady(step.freeze())
        return self._note_steady(self._schedule_decode().freeze())

    def _note_steady(self, step: ScheduledStep) -> ScheduledStep:
        """Record whether ``step`` is a plain decode step of every running sequence (``steady_decode_steps``)."""
        self._steady = (step.kind == "decode" and not step.preempted and not step.aborted and not step.moves.rounds
                       and len(step.entries) == len(self.running)
                       and all(entry.num_tokens == 1 and not entry.num_draft_tokens for entry in step.entries))
        return step

    def steady_decode_steps(self) -> int:
        """How many coming ``schedule()`` calls are certainly the plain decode step the last one was: every
        running sequence decodes one token, nothing is admitted, preempted, swapped in, aborted or copied.
        Provided each running sequence appends the one token its step samples after each of them, and nothing
        joins or leaves but what keeps the step (``add`` behind a waiting head that FCFS refused, ``remove`` of
        a running sequence while nothing waits), they repeat until a sequence needs a new block (the pool may
        then be short): whatever refused the waiting head (seats, token budget, pool) stays as it was, since
        the running set, the budget its decodes take and the free blocks do not change.
        0: no promise (the last step was not one; drafts, which change every step; a swap or a prefix-cache
        reset pending; a sliding window, which releases blocks; a subclass that did not opt in with
        ``repeats_plain_decode``). ``advance_steady_decode`` runs them in one go."""
        if (not self._steady or not self.repeats_plain_decode or self.swapped or self.prefix_reset_pending
                or getattr(self, "drafter", None) is not None
                or any(spec.sliding_window is not None for spec in self.manager.groups)):
            return 0
        bs, steps = self.manager.block_size, self.manager.block_size
        for seq in self.running:
            done = seq.num_computed_tokens  # the next step gives position `done` its slot
            if done != seq.num_tokens - 1 or done % bs == 0:  # it did not sample, or it needs a new block
                return 0
            steps = min(steps, bs - done % bs)  # steps 1 .. bs - done % bs fill its last block
        return steps

    def advance_steady_decode(self, steps: int, sample) -> None:
        """Run ``steps`` (1 .. ``steady_decode_steps()``) steady decode steps in one go, leaving the sequences
        and the block manager as ``steps`` calls of ``schedule()``, each followed by appending ``sample(seq)``
        to every running sequence, would: ``sample(seq)`` is the token ``seq``'s step samples (called in
        position order for each sequence; none may finish before the last step). Two ``append_slots`` calls
        (``steps - 1`` tokens, then one) leave the manager's records exactly as ``steps`` calls of one token
        would: no block is taken, and a block that fills is sealed with the same tokens and hash. Only the
        order of seals across sequences can differ: where two running sequences fill blocks of the same tokens,
        the prefix cache may keep the other one's (a study's generated tokens are private to each request)."""
        most = self.steady_decode_steps()
        if not is_int(steps) or not 1 <= steps <= most:
            raise InvalidArgumentError(f"steps must be a whole number from 1 to {most} (steady_decode_steps()), "
                                       f"got {steps!r}")
        for seq in self.running:
            for _ in range(steps - 1):  # the tokens steps 1 .. steps - 1 sample, each stored by the step after
                seq.append_token(sample(seq))
            if steps > 1:
                seq.scheduled_through(self.manager.append_slots(seq, num_new_tokens=steps - 1).num_computed_tokens)
            # the last step's: the records end as after `steps`
            seq.scheduled_through(self.manager.append_slots(seq, num_new_tokens=1).num_computed_tokens)
            seq.append_token(sample(seq))

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

    def _can_allocate(self, seq: Sequence, hit, num_new_tokens: int | None = None) -> AllocStatus:
        """Whether ``seq`` is admitted with ``hit`` and a first step of ``num_new_tokens`` tokens (None: all):
        kvlab's ``can_allocate``, or the answer of a learner's ``admission`` where one is plugged in."""
        status = self.manager.can_allocate(seq, num_new_tokens=num_new_tokens, hit=hit)
        return status if self.admission is None else self.admission(self.manager, seq, hit, num_new_tokens, status)

    def _schedule_prefill(self) -> StepBuilder:
        step = StepBuilder("prefill", self.sent_tables)
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
            hit = self.manager.lookup(seq)  # once: can_allocate and allocate take it
            status = self._can_allocate(seq, hit)
            if status is AllocStatus.LATER:
                break
            self.waiting.popleft()
            if status is AllocStatus.NEVER:
                step.aborted.append((seq, self._never_fits(seq)))
                continue
            admitted = self.manager.allocate(seq, hit=hit)
            seq.start_running(admitted)
            step.record_admission(admitted)
            step.add(self.manager, seq, seq.num_cached_tokens, prefill=True)
            step.num_cached_tokens += seq.num_cached_tokens
            seats += self._seats(seq)
            tokens += seq.num_tokens

    def _schedule_decode(self) -> StepBuilder:
        step = StepBuilder("decode", self.sent_tables)
        self._swap_in(step)
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            if self._make_room(seq, queue, step, others=bool(step.entries)):
                copies = self.manager.append_slots(seq)
                seq.scheduled_through(copies.num_computed_tokens)
                step.record("copy", copies)
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
            step.record("swap_in", self.manager.swap_in(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.swapped.popleft())

    def _preempt(self, seq: Sequence, step: StepBuilder) -> None:
        if self.preemption_mode == "swap" and self.manager.can_swap_out(seq) is AllocStatus.OK:
            step.record("swap_out", self.manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
        else:  # recompute (also the fallback when the CPU pool is full)
            self._free(seq, preempted=True)
            self.waiting.appendleft(seq)
        self.owner[seq.seq_id].metrics.num_preemptions += 1
        step.preempted.append(seq)
