"""Random allocate / append / fork / free / swap / reset programs against a model of the KV cache itself.

The model plays the engine: it writes each token's "K/V" (a value determined by the token and everything
before it) into the slots the manager hands out, applies copy-on-write and swap mappings, and after every
step checks that every live sequence reads back exactly its own prefix's values from its block table. That
one property catches wrong sharing, a missing copy, a stale swap copy or a block reused while in use;
``check_invariants`` runs after every step too.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab import AllocStatus, BlockManager, OutOfBlocksError, Sequence

PREFIXES = [[], [1, 2, 3, 1, 2], [1, 2, 3, 1, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3, 2]]
tokens = st.integers(0, 3)


def kv_values(token_ids):
    """Position p's value depends on tokens[:p+1], like real K/V."""
    values, running = [], 0
    for t in token_ids:
        running = hash((running, t))
        values.append(running)
    return values


class ManagerMachine(RuleBasedStateMachine):
    config = dict(num_blocks=24, block_size=4, num_cpu_blocks=12)

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(**self.config)
        self.gpu, self.cpu = {}, {}   # slot -> value: the engine's view of both caches
        self.running, self.swapped = [], []
        self.written = {}             # seq_id -> tokens whose K/V the engine wrote

    def _write(self, seq, start):
        bs = self.manager.block_size
        values = kv_values(seq.token_ids)
        for p, slot in enumerate(self.manager.slot_mapping(seq, start, seq.num_tokens), start):
            if slot >= 0:
                self.gpu[slot] = values[p]
        self.written[seq.seq_id] = seq.num_tokens
        assert len(seq.block_table) * bs >= seq.num_tokens

    def _copy(self, src_cache, dst_cache, pairs):
        bs = self.manager.block_size
        for src, dst in pairs:
            for offset in range(bs):
                if src * bs + offset in src_cache:
                    dst_cache[dst * bs + offset] = src_cache[src * bs + offset]
                else:
                    dst_cache.pop(dst * bs + offset, None)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, max_size=9))
    def allocate(self, prefix, suffix):
        seq = Sequence(prefix + suffix or [0], self.manager.block_size)
        if self.manager.can_allocate(seq) is AllocStatus.OK:
            self.manager.allocate(seq)
            assert seq.num_cached_tokens < seq.num_tokens
            self._write(seq, seq.num_cached_tokens)
            self.running.append(seq)
        else:
            try:
                self.manager.allocate(seq)
            except OutOfBlocksError:
                return
            raise AssertionError("allocate succeeded although can_allocate said it would not fit")

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new=st.lists(tokens, min_size=1, max_size=3), lookahead=st.integers(0, 3))
    def append(self, data, new, lookahead):
        seq = data.draw(st.sampled_from(self.running))
        for t in new:
            seq.append_token(t)
        if not self.manager.can_append_slots(seq, lookahead):
            try:
                self.manager.append_slots(seq, lookahead)
            except OutOfBlocksError:
                self.running.remove(seq)   # the engine would preempt it; we free it
                self.manager.free(seq, preempted=True)
                return
            raise AssertionError("append_slots succeeded although can_append_slots said no")
        self._copy(self.gpu, self.gpu, self.manager.append_slots(seq, lookahead))
        self._write(seq, self.written[seq.seq_id])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = Sequence([])
        self.manager.fork(parent, child)
        self.written[child.seq_id] = self.written[parent.seq_id]
        self.running.append(child)

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.running + self.swapped))
        (self.running if seq in self.running else self.swapped).remove(seq)
        self.manager.free(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.running))
        if self.manager.can_swap_out(seq):
            self._copy(self.gpu, self.cpu, self.manager.swap_out(seq))
            self.running.remove(seq)
            self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        if self.manager.can_swap_in(seq) is AllocStatus.OK:
            self._copy(self.cpu, self.gpu, self.manager.swap_in(seq))
            self.swapped.remove(seq)
            self.running.append(seq)

    @rule()
    def reset_prefix_cache(self):
        assert self.manager.reset_prefix_cache() == (not self.running)

    @invariant()
    def bookkeeping_is_consistent(self):
        self.manager.check_invariants()

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        for seq in self.running:
            n = self.written[seq.seq_id]
            expected = kv_values(seq.token_ids[:n])
            for p, slot in enumerate(self.manager.slot_mapping(seq, 0, n)):
                if slot >= 0:
                    assert self.gpu.get(slot) == expected[p], f"seq {seq.seq_id} position {p} reads wrong K/V"


class WeakHashMachine(ManagerMachine):
    config = dict(num_blocks=24, block_size=2, num_cpu_blocks=12, hash_fn=lambda parent, token_ids: 7)


class SlidingWindowMachine(ManagerMachine):
    config = dict(num_blocks=16, block_size=2, num_cpu_blocks=12, sliding_window=5)


class FIFOMachine(ManagerMachine):
    config = dict(num_blocks=16, block_size=2, num_cpu_blocks=8, eviction="fifo")


class LFUMachine(ManagerMachine):
    config = dict(num_blocks=16, block_size=2, num_cpu_blocks=8, eviction="lfu")


class NoPrefixCachingMachine(ManagerMachine):
    config = dict(num_blocks=20, block_size=3, num_cpu_blocks=8, enable_prefix_caching=False)


def _test_case(machine):
    case = machine.TestCase
    case.settings = settings(stateful_step_count=40, deadline=None)  # max_examples comes from the profile
    return case


TestManager = _test_case(ManagerMachine)
TestWeakHash = _test_case(WeakHashMachine)
TestSlidingWindow = _test_case(SlidingWindowMachine)
TestNoPrefixCaching = _test_case(NoPrefixCachingMachine)
TestFIFO = _test_case(FIFOMachine)
TestLFU = _test_case(LFUMachine)
