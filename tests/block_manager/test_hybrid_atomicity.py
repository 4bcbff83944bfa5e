"""A hybrid manager's call that fails changes nothing, in any group.

Every operation of ``HybridBlockManager`` that calls the eviction policy or ``hash_fn`` is run with each of
those calls failing in turn: the first group's calls and the later groups' alike (before, a failure in group
g left groups 0..g-1 with their part done). The call must raise and leave the whole manager as it was: every
group's tables and progress, the shared pool (ref counts, hashes, contents, the free set), the CPU pool, every
group's prefix-cache stats, the teaching events and the KV events; and it must succeed when tried again.
"""

import pytest
from test_failing_policy import FlakyPolicy

from kvlab import EvictionPolicyError, InvalidArgumentError, Sequence
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec

BS = 2


class FlakyHash:
    """A weak hash that raises once, on its call number ``fail_at`` (0-based) after arming."""

    def __init__(self):
        self.calls, self.fail_at = 0, None

    def __call__(self, parent, token_ids):
        self.calls += 1
        if self.fail_at is not None:
            if self.fail_at == 0:
                self.fail_at = None
                raise RuntimeError("hash_fn is broken")
            self.fail_at -= 1
        return hash((parent, token_ids)) & 0xFFFF


class Setup:
    """A two-group manager with a flaky policy (and a flaky ``hash_fn`` with ``flaky_hash``: kvlab's own hash
    otherwise, since a ``hash_fn`` sees no keys, so the groups' equal tokens compete for one hash and never
    hit in both), a KV-event subscriber, and the sequences to watch."""

    def __init__(self, flaky_hash: bool):
        self.policy, self.hash_fn, self.delivered = FlakyPolicy(), FlakyHash(), []
        self.m = HybridBlockManager(24, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(2)], num_cpu_blocks=16,
                                    eviction=self.policy, hash_fn=self.hash_fn if flaky_hash else None,
                                    record_events=True, kv_events=True)
        self.m.kv_events.subscribe(self.delivered.append)
        self.seqs = []

    def allocated(self, tokens) -> Sequence:
        seq = Sequence(tokens, BS)
        self.m.allocate(seq)
        self.seqs.append(seq)
        return seq

    def state(self) -> tuple:
        """Everything a failed call must leave as it was (the free set as a set: its order is the policy's)."""
        m = self.m
        pool, index, swap = m._pool, m._pool.index, m._swap
        seqs = [(s.status, s.num_cached_tokens, s.num_tokens) +
                ((m.block_tables(s), m.num_scheduled_tokens(s)) if s.block_table else ()) for s in self.seqs]
        return (list(pool.ref), list(index.hash), list(index.content), list(index.registered), sorted(pool.policy),
                pool.num_free, pool.evictions, list(swap.ref), swap.num_free, dict(swap._cpu_of),
                vars(m.stats).copy(), list(m.events), list(self.delivered), seqs)


# Each scenario builds a Setup and returns the operation to fail.
def allocate_with_hits(s):
    s.m.free(s.allocated(range(9)))           # every group's blocks are free and cached
    new = Sequence([*range(8), 7, 7, 7], BS)    # hits 4 blocks in each group, the window's first ones out of it
    s.seqs.append(new)
    return lambda: s.m.allocate(new)


def append_with_copy_and_release(s):
    parent = s.allocated(range(5))
    child = Sequence([])
    s.m.fork(parent, child)
    s.seqs.append(child)
    for t in (9, 9, 9, 9):                      # copies the shared partial block in each group, takes new ones,
        child.append_token(t)                   # seals two blocks per group, and the window releases two
    return lambda: s.m.append_slots(child)


def append_with_release(s):
    seq = s.allocated(range(5))
    for t in (9, 9, 9, 9):                      # the window frees two blocks, each group takes new ones
        seq.append_token(t)
    return lambda: s.m.append_slots(seq)


def accept_drafts(s):
    seq = s.allocated(range(5))
    s.m.append_slots(seq, num_draft_tokens=3)   # positions 5..7 are drafts
    for t in (9, 9, 9):
        seq.append_token(t)                     # all accepted: blocks 2 and 3 get sealed in each group
    return lambda: s.m.accept_drafts(seq, 3)


def free(s):
    seq = s.allocated(range(7))
    return lambda: s.m.free(seq)


def swap_out(s):
    seq = s.allocated(range(7))
    return lambda: s.m.swap_out(seq)


def swap_in(s):
    seq = s.allocated(range(7))
    s.m.swap_out(seq)
    return lambda: s.m.swap_in(seq)


SCENARIOS = [allocate_with_hits, append_with_copy_and_release, append_with_release, accept_drafts, free, swap_out,
             swap_in]


def failures():
    """(scenario, what fails, which of its calls): every policy hook and hash call each scenario makes."""
    cases = []
    for scenario in SCENARIOS:
        for flaky_hash in (False, True):
            s = Setup(flaky_hash)
            operation = scenario(s)
            s.policy.calls.clear()
            hash_calls = s.hash_fn.calls
            operation()
            if flaky_hash:
                cases += [(scenario, "hash_fn", k) for k in range(s.hash_fn.calls - hash_calls)]
            else:
                cases += [(scenario, hook, k) for hook in dict.fromkeys(s.policy.calls)
                          for k in range(s.policy.calls.count(hook))]
    return cases


CASES = failures()


def test_the_cases_reach_every_hook_in_every_group():
    """Each scenario's calls are made in both groups (so a later group's fail too), and every hook is failed."""
    assert {scenario for scenario, _, k in CASES if k >= 1} == set(SCENARIOS)
    assert {what for _, what, _ in CASES} == {"remove", "pop", "on_hit", "add", "hash_fn"}
    assert {scenario for scenario, what, _ in CASES if what == "hash_fn"} == {
        allocate_with_hits, append_with_copy_and_release, append_with_release, accept_drafts}


@pytest.mark.parametrize("scenario, what, k", CASES, ids=[f"{s.__name__}-{w}-{k}" for s, w, k in CASES])
def test_a_failing_call_changes_no_group(scenario, what, k):
    s = Setup(flaky_hash=what == "hash_fn")
    operation = scenario(s)
    before = s.state()
    if what == "hash_fn":
        s.hash_fn.fail_at = k
        error, message = InvalidArgumentError, "hash_fn raised RuntimeError: hash_fn is broken"
    else:
        s.policy.fail_on, s.policy.after = what, k
        error, message = EvictionPolicyError, f"FlakyPolicy.{what} raised RuntimeError: {what} is broken"
    with pytest.raises(error, match=message):
        operation()
    assert s.state() == before
    s.m.check_invariants()
    operation()                       # the same call succeeds on the next try
    s.m.check_invariants()
