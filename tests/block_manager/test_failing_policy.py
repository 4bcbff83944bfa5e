"""A user eviction policy that raises (or breaks its contract) never corrupts the manager.

Every operation that calls the policy is run with each hook it calls failing once, on the hook's first call
and on a later one (so some calls of the operation already succeeded and must be undone). The operation
must raise EvictionPolicyError, leave the manager exactly as it was (the free set may list the same blocks
in another order: that order is the policy's own business), and work when it is tried again.
"""

from collections import OrderedDict

import pytest

from kvlab import BlockManager, EvictionPolicy, EvictionPolicyError, InvariantViolation, Sequence

from helpers import allocated, grow


class FlakyPolicy(EvictionPolicy):
    """Oldest-freed-first; ``fail_on = hook`` makes that hook raise once, after ``after`` successful calls."""

    def __init__(self):
        self._free = OrderedDict()
        self.fail_on, self.after = None, 0
        self.calls = []

    def _call(self, hook):
        self.calls.append(hook)
        if hook == self.fail_on:
            if self.after == 0:
                self.fail_on = None
                raise RuntimeError(f"{hook} is broken")
            self.after -= 1

    def add(self, block_id, cached):
        self._call("add")
        self._free[block_id] = cached

    def remove(self, block_id):
        self._call("remove")
        del self._free[block_id]

    def pop(self):
        self._call("pop")
        return self._free.popitem(last=False)[0]

    def on_hit(self, block_id):
        self._call("on_hit")

    def on_access(self, block_id, now):
        self._call("on_access")

    def __iter__(self):
        return iter(list(self._free))

    def __len__(self):
        return len(self._free)


def state(manager, seqs):
    """Everything a failed operation must leave unchanged (the free set as a set)."""
    n = manager.num_blocks
    return ([manager.ref_count(b) for b in range(n)], [manager.block_hash(b) for b in range(n)],
            [manager.is_cached(b) for b in range(n)], sorted(manager.free_block_ids()), manager.num_free_blocks,
            vars(manager.stats).copy(), manager.num_evictions, manager.num_free_cpu_blocks, len(manager.events),
            [(s.block_table, s.status, s.num_cached_tokens, s.num_tokens) for s in seqs])


def _manager(**kwargs):
    policy = FlakyPolicy()
    return BlockManager(12, block_size=2, num_cpu_blocks=8, eviction=policy, record_events=True, **kwargs), policy


# Each scenario sets a manager up and returns (manager, policy, sequences to watch, the operation).
def allocate_with_hits():
    m, policy = _manager()
    m.free(allocated(m, [1, 2, 3, 4, 5]))                     # two warm blocks
    new = Sequence([1, 2, 3, 4, 9, 9, 9], 2)                  # hits both (revives them), needs two more
    return m, policy, [new], lambda: m.allocate(new)


def append_with_copy_on_write():
    m, policy = _manager()
    parent = allocated(m, [1, 2, 3])
    child = Sequence([])
    m.fork(parent, child)
    child.append_token(4)                                     # the shared partial block is copied...
    for t in (5, 6):
        child.append_token(t)                                 # ...and a new block is needed
    return m, policy, [parent, child], lambda: m.append_slots(child)


def append_with_window_release():
    m, policy = _manager(sliding_window=2)
    seq = allocated(m, [1, 2, 3])
    for t in range(4, 8):
        seq.append_token(t)
    m.append_slots(seq)                                       # positions 0..6 in blocks 0..3
    for t in range(8, 13):
        seq.append_token(t)                                   # releases blocks 1 and 2, takes two new ones
    return m, policy, [seq], lambda: m.append_slots(seq)


def free_a_sequence():
    m, policy = _manager()
    seq = allocated(m, [1, 2, 3, 4, 5])
    return m, policy, [seq], lambda: m.free(seq)


def swap_out_and_in():
    m, policy = _manager()
    seq = allocated(m, [1, 2, 3, 4, 5])
    return m, policy, [seq], lambda: m.swap_in(seq) if m.is_swapped(seq) else m.swap_out(seq)


def swap_in():
    m, policy, seqs, _ = swap_out_and_in()
    m.swap_out(seqs[0])
    return m, policy, seqs, lambda: m.swap_in(seqs[0])


def reset_prefix_cache():
    m, policy = _manager()
    m.free(allocated(m, [1, 2, 3, 4, 5]))
    return m, policy, [], m.reset_prefix_cache


def free_cross():
    m, policy = _manager()
    seq = Sequence([1, 2, 3], 2)
    m.allocate(seq, encoder_seq=Sequence([7, 8, 9, 10, 11], 2))
    return m, policy, [seq], lambda: m.free_cross(seq)


def touch():
    m, policy = _manager()
    seq = allocated(m, [1, 2, 3, 4, 5])
    return m, policy, [seq], lambda: m.touch(seq, 1.0)


CASES = [
    (allocate_with_hits, "remove"), (allocate_with_hits, "pop"), (allocate_with_hits, "on_hit"),
    (append_with_copy_on_write, "pop"), (append_with_window_release, "add"),
    (append_with_window_release, "pop"), (free_a_sequence, "add"), (swap_out_and_in, "add"),
    (swap_in, "pop"), (reset_prefix_cache, "remove"), (reset_prefix_cache, "add"), (free_cross, "add"),
    (touch, "on_access"),
]


@pytest.mark.parametrize("after", [0, 1], ids=["first call fails", "a later call fails"])
@pytest.mark.parametrize("scenario, hook", CASES, ids=[f"{s.__name__}-{h}" for s, h in CASES])
def test_a_raising_hook_changes_nothing(scenario, hook, after):
    m, policy, seqs, operation = scenario()
    policy.calls.clear()
    before = state(m, seqs)
    policy.fail_on, policy.after = hook, after
    with pytest.raises(EvictionPolicyError, match=f"FlakyPolicy.{hook} raised RuntimeError: {hook} is broken"):
        operation()
    assert state(m, seqs) == before
    m.check_invariants()
    if after == 1:
        assert policy.calls.count(hook) >= 2, "the scenario must call the hook more than once"
    operation()                       # the same operation succeeds on the next try
    m.check_invariants()


def test_a_policy_that_hands_out_a_block_in_use_is_refused():
    m, policy = _manager()
    busy = allocated(m, [1, 2, 3])
    policy.pop = lambda: busy.block_table[0]    # breaks the contract: that block is in use
    before = state(m, [busy])
    with pytest.raises(EvictionPolicyError, match="not a free block"):
        m.allocate(Sequence([5, 6, 7], 2))
    assert state(m, [busy]) == before


def test_a_policy_that_cannot_undo_says_so_and_the_checker_notices():
    m, policy = _manager()
    m.free(allocated(m, [1, 2, 3, 4, 5]))
    policy.add = lambda block_id, cached: (_ for _ in ()).throw(RuntimeError("add is gone"))
    with pytest.raises(EvictionPolicyError, match="undoing the calls before it raised"):
        m.reset_prefix_cache()                # it removed blocks, and cannot put them back
    with pytest.raises(InvariantViolation, match="free set"):
        m.check_invariants()


def test_a_user_policy_may_hand_out_a_block_the_same_step_freed():
    """A window step frees the block that left the window, then takes one: a most-recently-freed-first policy
    hands out that very block, which is free though its count drops only after the policy calls (found by
    the hybrid state machine)."""
    policy = FlakyPolicy()
    policy.pop = lambda: policy._free.popitem(last=True)[0]
    m = BlockManager(8, 2, sliding_window=2, eviction=policy)
    seq = Sequence([1, 2, 3, 1, 2], 2)
    m.allocate(seq, num_new_tokens=3)
    released = seq.block_table[0]
    m.append_slots(seq)
    assert seq.block_table[0] == 0 and released in seq.block_table[1:]
    m.check_invariants()
