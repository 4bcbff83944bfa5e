"""Model check of KV cache groups: random programs run against HybridBlockManager and a fake KV cache.

As in test_stateful, the machine plays the engine, but a model with several layer kinds writes each group's
K/V through that group's slot mapping. The fake caches (slot -> value) are keyed by the shared pool's slots,
and a value names its group, so a block that two groups (or two sequences) both write is caught when the
loser reads. After each step, and after every operation, every live sequence reads back in each group what
that group's attention sees: every position in a full-attention group, the last W before the step's first
query in a window-W group. Every rule of the single-group machine that the hybrid manager offers is here:
whole and chunked admissions with prefix hits (also continuations of earlier requests, and tenants' salts),
steps of all pending tokens or of a chunk of them with lookahead slots, speculative steps whose drafts are
then verified or rejected (kvlab.blocks.group_manager: window groups release blocks by verified positions only),
forks, frees (preempted or finished), swaps and prefix-cache resets; weak hashes and a user-written eviction
policy too. (The hybrid manager has no
``touch``, so there is no ``touch`` rule.)

Failures: in the machines with a faulty user policy or ``hash_fn``, a rule runs another rule with the k-th call
of that code from now raising, which may be any group's call: the call must fail with nothing changed in any
group (tables, progress, the shared pools, the stats), and the rules touch the machine's books only after the
manager's call succeeded, so the program goes on from the state before.
"""

import itertools
import os

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab import AllocStatus, EvictionPolicyError, InvalidArgumentError, OutOfBlocksError, Sequence
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from test_stateful import PREFIXES, PoolRules, StackPolicy, kv_values, salts, tokens

_junk = itertools.count()


class Faults:
    """Makes the k-th call from now of a user's eviction policy or ``hash_fn`` raise (0: the next one)."""

    def __init__(self):
        self.countdown = None

    def call(self):
        if self.countdown is not None:
            if self.countdown == 0:
                self.countdown = None
                raise RuntimeError("injected fault")
            self.countdown -= 1

    def weak_hash(self, parent, token_ids):
        self.call()
        return hash((parent, token_ids)) % 64


class FaultyStackPolicy(StackPolicy):
    def __init__(self, faults):
        super().__init__()
        self.faults = faults

    def add(self, block_id, cached):
        self.faults.call()
        super().add(block_id, cached)

    def remove(self, block_id):
        self.faults.call()
        super().remove(block_id)

    def pop(self):
        self.faults.call()
        return super().pop()


class HybridMachine(PoolRules, RuleBasedStateMachine):
    config = dict(num_blocks=32, block_size=2, num_cpu_blocks=16, groups=[FullAttentionSpec(), SlidingWindowSpec(3)])

    def __init__(self):
        super().__init__()
        config = dict(self.config)
        if isinstance(config.get("eviction"), type):   # a policy class: a fresh instance per program
            config["eviction"] = config["eviction"]()
        faulty = config.pop("faulty", None)            # "policy" or "hash_fn": user code that fails when armed
        self.faults = Faults() if faulty else None
        if faulty == "policy":
            config["eviction"] = FaultyStackPolicy(self.faults)
        elif faulty == "hash_fn":
            config["hash_fn"] = self.faults.weak_hash
        self.manager = HybridBlockManager(**config)
        self.windows = [spec.sliding_window for spec in self.manager.groups]
        self.sizes = self.manager.group_block_sizes
        # (block, offset) -> (group, value): every group's K/V in the one shared pool, whose pages hold a group's
        # block of its size (groups may differ: a slot number alone would be ambiguous)
        self.gpu, self.cpu = {}, {}
        self.running, self.swapped = [], []
        self.written, self.reserved, self.first_query, self.drafts = {}, {}, {}, {}   # as in ManagerMachine
        self.history = []

    # ---- the engine's side ---------------------------------------------------------------------------
    def _step(self, seq, first_query, lookahead=0, end=None, drafts=()):
        """Write the step's tokens first_query..end-1 in every group (then the drafts'; and junk in lookahead
        slots), then check what each group's attention reads."""
        n = seq.num_tokens if end is None else end
        scheduled = n + len(drafts)
        assert self.manager.num_scheduled_tokens(seq) == scheduled
        values = kv_values(seq, drafts=drafts)
        for g, slots in enumerate(self.manager.slot_mappings(seq, first_query, scheduled + lookahead)):
            for p, slot in enumerate(slots, first_query):
                assert slot >= 0, f"group {g}: position {p} of the step has no slot"
                self.gpu[self._page(g, slot)] = (g, values[p]) if p < scheduled else ("junk", next(_junk))
        self.written[seq], self.first_query[seq] = n, first_query
        self.reserved[seq] = max(self.reserved.get(seq, 0), scheduled + lookahead)
        assert all(len(table) * bs >= scheduled + lookahead
                   for table, bs in zip(self.manager.block_tables(seq), self.sizes))
        self._check_reads(seq)

    def _check_reads(self, seq):
        """Every group still maps, with its own values, what its queries from ``first_query`` on can see."""
        n = self.written[seq]
        expected = kv_values(seq, n)
        for g, slots in enumerate(self.manager.slot_mappings(seq, 0, n)):
            window = self.windows[g]
            visible = 0 if window is None else max(0, self.first_query[seq] - window + 1)
            for p, slot in enumerate(slots):
                assert slot >= 0 or p < visible, f"seq {seq.seq_id} group {g}: position {p} released while visible"
                if slot >= 0:
                    assert self.gpu.get(self._page(g, slot)) == (g, expected[p]), \
                        f"seq {seq.seq_id} group {g} reads wrong K/V at position {p}"

    def _slots(self, seq, start, end):
        return self.manager.slot_mappings(seq, start, end)

    def _page(self, group, slot):
        return divmod(slot, self.sizes[group])

    def _copy(self, src_cache, dst_cache, pairs):
        """Apply the manager's (src, dst) block pairs, in order: each copies a whole page."""
        for src, dst in pairs:
            for offset in range(max(self.sizes)):
                if (src, offset) in src_cache:
                    dst_cache[dst, offset] = src_cache[src, offset]
                else:
                    dst_cache.pop((dst, offset), None)

    def _forget(self, seq):
        (self.running if seq in self.running else self.swapped).remove(seq)
        del self.written[seq], self.first_query[seq], self.reserved[seq]
        self.drafts.pop(seq, None)

    # ---- rules -----------------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, max_size=9), salt=salts,
          chunked=st.booleans())
    def allocate(self, data, prefix, suffix, salt, chunked):
        self._allocate(prefix + suffix or [0], data if chunked else None, cache_salt=salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), suffix=st.lists(tokens, max_size=3), salt=salts, chunked=st.booleans())
    def allocate_a_continuation(self, data, suffix, salt, chunked):
        """A new request that repeats part of an earlier one: hits in every group, where the tenant agrees."""
        earlier = data.draw(st.sampled_from(self.history))
        token_ids = earlier[:data.draw(st.integers(1, len(earlier)))] + suffix
        self._allocate(token_ids, data if chunked else None, cache_salt=salt)

    def _allocate(self, token_ids, data=None, **keys):
        """Admit a prompt: all of it, or (drawing from ``data``) its hits and a first chunk of the rest."""
        seq = Sequence(token_ids, self.manager.block_size, **keys)
        cached = self.manager.get_num_cached_tokens(seq)
        num_new_tokens = None if data is None else data.draw(st.integers(1, seq.num_tokens - cached))
        if self.manager.can_allocate(seq, num_new_tokens=num_new_tokens) is not AllocStatus.OK:
            try:
                self.manager.allocate(seq, num_new_tokens=num_new_tokens)
            except OutOfBlocksError:
                return
            raise AssertionError("allocate succeeded although can_allocate said it would not fit")
        admitted = self.manager.allocate(seq, num_new_tokens=num_new_tokens)
        self._copy(self.gpu, self.gpu, admitted.copies)  # a partial-block hit's units, every group's
        assert seq.num_cached_tokens == cached < seq.num_tokens
        self.history.append(seq.token_ids)
        self.running.append(seq)
        end = None if num_new_tokens is None else cached + num_new_tokens
        self._step(seq, cached, end=end)

    @precondition(lambda self: self._undrafted(self.running + self.swapped))
    @rule(data=st.data(), new=st.lists(tokens, min_size=1, max_size=9))
    def append_tokens(self, data, new):
        seq = data.draw(st.sampled_from(self._undrafted(self.running + self.swapped)))
        for t in new:
            seq.append_token(t)

    @precondition(lambda self: self._undrafted())
    @rule(data=st.data(), new=st.lists(tokens, max_size=5), lookahead=st.integers(0, 3), chunked=st.booleans())
    def step(self, data, new, lookahead, chunked):
        """One engine step: the pending tokens plus ``new`` ones, or (``chunked``) the next 1..all of them."""
        seq = data.draw(st.sampled_from(self._undrafted()))
        for t in new:
            seq.append_token(t)
        first_query = self.written[seq]
        k = None
        if chunked and seq.num_tokens > first_query:
            k = data.draw(st.integers(1, seq.num_tokens - first_query))
        if not self.manager.can_append_slots(seq, lookahead, num_new_tokens=k):
            try:
                self.manager.append_slots(seq, lookahead, num_new_tokens=k)
            except OutOfBlocksError:
                self.manager.free(seq, preempted=True)   # the engine would preempt it; we free it
                self._forget(seq)
                return
            raise AssertionError("append_slots succeeded although can_append_slots said no")
        self._copy(self.gpu, self.gpu, self.manager.append_slots(seq, lookahead, num_new_tokens=k))
        self._step(seq, first_query, lookahead, end=None if k is None else first_query + k)
        self.history.append(seq.token_ids)

    @precondition(lambda self: self.faults is not None)
    @rule(data=st.data(), k=st.integers(0, 7))
    def a_failing_call_changes_nothing(self, data, k):
        """Another rule, with the k-th call of the faulty user code from now raising (in any group's part).
        (Not ``accept_drafts``: the engine appends the accepted tokens before it, so a failed one is not retried
        as it is.)"""
        operations = {
            "allocate": lambda: self.allocate(data, data.draw(st.sampled_from(PREFIXES)),
                                              data.draw(st.lists(tokens, max_size=9)), data.draw(salts),
                                              data.draw(st.booleans())),
            "step": lambda: self.step(data, data.draw(st.lists(tokens, max_size=5)), data.draw(st.integers(0, 3)),
                                      data.draw(st.booleans())),
            "propose": lambda: self.propose(data, data.draw(st.lists(tokens, max_size=3)),
                                            data.draw(st.lists(tokens, min_size=1, max_size=6)),
                                            data.draw(st.integers(0, 2))),
            "free": lambda: self.free(data, data.draw(st.booleans())),
            "swap_out": lambda: self.swap_out(data),
            "swap_in": lambda: self.swap_in(data),
        }
        live = {"step": self._undrafted(), "propose": self._undrafted(), "free": self.running + self.swapped,
                "swap_out": self.running, "swap_in": self.swapped}
        operation = data.draw(st.sampled_from([name for name in operations if live.get(name, True)]))
        before = self._manager_state()
        self.faults.countdown = k
        try:
            operations[operation]()
        except (EvictionPolicyError, InvalidArgumentError) as error:
            if "injected fault" not in str(error):
                raise
            assert self._manager_state() == before, f"a failed {operation} changed the manager"
        finally:
            self.faults.countdown = None

    def _manager_state(self):
        """Everything a failed call must leave as it was (the free set as a set: its order is the policy's)."""
        m = self.manager
        pool, index, swap = m._pool, m._pool.index, m._swap
        return (list(pool.ref), list(index.hash), list(index.content), list(index.registered), sorted(pool.policy),
                pool.num_free, pool.evictions, list(swap.ref), swap.num_free, dict(swap._cpu_of),
                vars(m.stats).copy(),
                [(s.status, s.num_cached_tokens, m.block_tables(s), m.num_scheduled_tokens(s))
                 for s in self.running + self.swapped])

    # ---- invariants ------------------------------------------------------------------------------------
    @invariant()
    def every_group_reads_back_its_own_kv(self):
        for seq in self.running:
            self._check_reads(seq)


def _machine(name, *groups, **config):
    return type(name, (HybridMachine,), {"config": dict(config, groups=list(groups))})


FULL, W2, W3, W5 = FullAttentionSpec(), SlidingWindowSpec(2), SlidingWindowSpec(3), SlidingWindowSpec(5)
MACHINES = [
    _machine("HybridFullWindow3", FULL, W3, num_blocks=32, block_size=2, num_cpu_blocks=16),
    _machine("HybridWindowsFirst", W5, W2, FULL, num_blocks=40, block_size=2, num_cpu_blocks=16),
    _machine("HybridTwoWindows", W2, W5, num_blocks=24, block_size=3, num_cpu_blocks=12),
    _machine("HybridConstantHash", FULL, W3, num_blocks=32, block_size=2, num_cpu_blocks=16,
             hash_fn=lambda parent, ids: 7),
    _machine("HybridUserPolicy", FULL, W2, num_blocks=24, block_size=2, num_cpu_blocks=8, eviction=StackPolicy),
    _machine("HybridTwoFullUnits", FULL, FULL, num_blocks=32, block_size=4, num_cpu_blocks=16, prefix_match_unit=1),
    _machine("HybridTwoFullUnitsStack", FULL, FULL, num_blocks=24, block_size=4, num_cpu_blocks=8, prefix_match_unit=1,
             eviction=StackPolicy),
    # groups of different block sizes (hashed at block_size, each group's blocks merged from those)
    _machine("HybridMixedSizes", FULL, W3, num_blocks=40, block_size=2, num_cpu_blocks=16, group_block_sizes=[6, 2]),
    _machine("HybridMixedUnits", W3, FULL, FULL, num_blocks=48, block_size=2, num_cpu_blocks=16,
             group_block_sizes=[2, 8, 4], prefix_match_unit=2),
    _machine("HybridMixedUnitsStack", FULL, W2, num_blocks=32, block_size=2, num_cpu_blocks=8,
             group_block_sizes=[6, 2], prefix_match_unit=2, eviction=StackPolicy),
    _machine("HybridMixedFailingHash", FULL, FULL, num_blocks=32, block_size=2, num_cpu_blocks=8,
             group_block_sizes=[4, 2], prefix_match_unit=1, faulty="hash_fn"),
    _machine("HybridMixedFailingPolicy", FULL, FULL, num_blocks=32, block_size=2, num_cpu_blocks=8,
             group_block_sizes=[2, 4], prefix_match_unit=1, faulty="policy"),
    _machine("HybridEagle", FULL, W3, num_blocks=24, block_size=2, num_cpu_blocks=8, use_eagle=True),
    _machine("HybridFailingPolicy", W2, FULL, num_blocks=24, block_size=2, num_cpu_blocks=8, faulty="policy"),
    _machine("HybridFailingHash", FULL, W3, num_blocks=24, block_size=2, num_cpu_blocks=8, faulty="hash_fn"),
]

STEPS = int(os.environ.get("KVLAB_STATEFUL_STEPS", "40"))
for _machine_class in MACHINES:
    _case = _machine_class.TestCase
    _case.settings = settings(stateful_step_count=STEPS, deadline=None)
    globals()[f"Test{_machine_class.__name__}"] = _case
del _case
