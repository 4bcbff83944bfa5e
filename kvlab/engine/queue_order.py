"""Which waiting sequence admission tries first: arrival order ("fcfs") or longest cached prefix ("lpm").

"fcfs" is vLLM's default (``--scheduling-policy fcfs``): the waiting queue in arrival order, preempted
sequences in front. "lpm" is SGLang's ``--schedule-policy lpm`` (``CacheAwarePolicy.LPM`` in
``sglang/srt/managers/schedule_policy.py``), and what vLLM RFC #42185 proposes for the V1 scheduler: before
each admission pass the waiting sequences are tried in order of the prompt tokens a lookup would hit now
(``manager.get_num_cached_tokens``: GPU pool and offload tier), most first, ties in queue order. A warm
prompt then runs before a cold one that arrived first, and before the cold one's blocks evict what the
warm one needed.

Two guards fall back to FCFS for a pass:

* the queue holds more than ``LPM_QUEUE_LIMIT`` sequences (SGLang's ``_determine_active_policy``: past 128
  waiting requests LPM is turned off; there, to bound the cost of matching and sorting every pass);
* a waiting sequence was overtaken ``LPM_MAX_OVERTAKES`` times (admissions of sequences queued behind it).
  SGLang's length threshold alone does not bound starvation (a cold request keeps losing to warm arrivals
  while the queue is short: SGLang issue #31954); this one does: an overtaken sequence is tried first once
  the bound is reached, as FCFS would.

The queue itself stays in FCFS order: a pass reorders it for its admissions and puts the sequences it did not
admit back in their queue order afterwards, so preemption (``appendleft``) and the FCFS fall-back see the
queue as FCFS keeps it.
"""

from contextlib import contextmanager

from kvlab.errors import InvalidArgumentError

#: The values ``LLM(scheduling_policy=...)`` accepts.
QUEUE_POLICIES = ("fcfs", "lpm")
#: More waiting sequences than this and a pass admits FCFS (SGLang's constant).
LPM_QUEUE_LIMIT = 128
#: A waiting sequence overtaken this many times makes the pass FCFS, so it is tried first.
LPM_MAX_OVERTAKES = 64


def check_queue_policy(policy) -> str:
    if not isinstance(policy, str) or policy not in QUEUE_POLICIES:
        raise InvalidArgumentError(f"scheduling_policy must be one of {QUEUE_POLICIES}, got {policy!r}")
    return policy


class WaitingOrder:
    """A scheduler's admission order (``Scheduler.waiting_order``); ``overtaken`` maps the seq_id of a waiting
    sequence to the admissions that passed it (only under "lpm")."""

    def __init__(self, policy: str = "fcfs"):
        self.policy = check_queue_policy(policy)
        self.overtaken: dict[int, int] = {}

    def falls_back(self, waiting) -> bool:
        """Whether this pass admits FCFS although the policy is "lpm" (see the module docstring)."""
        return len(waiting) > LPM_QUEUE_LIMIT or any(
            self.overtaken.get(seq.seq_id, 0) >= LPM_MAX_OVERTAKES for seq in waiting)

    @contextmanager
    def admission_pass(self, scheduler):
        """Reorder ``scheduler.waiting`` for the admissions made inside the block (it pops from the front), then
        restore queue order for the sequences left and count who was overtaken."""
        waiting = scheduler.waiting
        if self.policy == "fcfs" or len(waiting) < 2 or self.falls_back(waiting):
            yield
            return
        queue_rank = {seq.seq_id: rank for rank, seq in enumerate(waiting)}
        cached = scheduler.manager.get_num_cached_tokens
        waiting_sorted = sorted(waiting, key=lambda seq: -cached(seq))  # stable: ties keep queue order
        waiting.clear()
        waiting.extend(waiting_sorted)
        try:
            yield
        finally:
            left = sorted(waiting, key=lambda seq: queue_rank[seq.seq_id])
            still = {seq.seq_id for seq in left}
            admitted = [rank for seq_id, rank in queue_rank.items() if seq_id not in still]  # or aborted
            overtaken = self.overtaken
            self.overtaken = {seq.seq_id: overtaken.get(seq.seq_id, 0)
                              + sum(rank > queue_rank[seq.seq_id] for rank in admitted) for seq in left}
            waiting.clear()
            waiting.extend(left)
