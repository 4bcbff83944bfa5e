"""Model check: random programs run against the block manager and a fake KV cache that an engine would keep.

The machine plays the engine. Its fake caches (slot -> value, for the GPU and the CPU pool) receive every
write the slot mapping asks for (a step's new tokens, and junk in lookahead slots, as speculative tokens
that get rejected leave), every copy-on-write pair and every swap mapping. A position's value depends on the
token there and every token before it, like real K/V. After each step it checks what attention would read:
every position the step's queries can see (``first_query - W + 1`` on, with a sliding window of W) must be
mapped and hold its own value, prefix hits included. After every operation, also between ``append_token``
and ``append_slots``, every live sequence reads back each written position it still maps, and
``check_invariants`` holds. Weak and constant hash functions, sliding windows, multi-token steps, forks and
swaps with tokens not yet given slots, every eviction policy and a user-written one are all exercised, and so
are tenants: sequences with cache salts, adapter keys and per-block extra keys, whose values depend on them
(a hit on another tenant's or another image's block reads wrong K/V).

Chunked prompts: a prompt may be admitted with only its first chunk scheduled (``num_new_tokens``), and a
step may schedule only the next chunk of the tokens without slots, of any size from one token (so chunks
end inside blocks). Every prompt joins the history at admission, so later requests try to hit blocks whose
tokens are still to be computed (nano-vllm #208/#219): such a hit would read K/V nobody wrote.

Partial-block hits (``prefix_match_unit`` finer than the block): the units a hit finds in a block are copied
into the new block the manager gives, as the engine applies ``Admitted.copies`` before the step; the readback
then checks the copied positions too.

Speculative decoding (kvlab.blocks.group_manager): a step may propose draft tokens after the last one, whose K/V (of
the tokens they would be) the verification pass writes; then the drafts are verified (the first 1..all
accepted, their tokens appended, optionally a bonus token) or all rejected, and the progress counter rolls
back. The tokens with their drafts join the history, so later requests try to hit blocks holding drafts: a
hit on one that was rejected would read K/V of tokens the sequence never had, as would a sequence reading a
rejected position it did not write again. Forks, swaps and frees happen with drafts in flight.
"""

import itertools
import os

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab import AllocStatus, BlockManager, EvictionPolicy, InvalidArgumentError, OutOfBlocksError, Sequence

PREFIXES = [[], [1, 2, 3, 1, 2], [1, 2, 3, 1, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3, 2]]
tokens = st.integers(0, 2)  # few distinct tokens: many accidental prefix hits
# Few values, shared by salts, adapters and per-block keys: a salt meets an equal adapter or block key, and "a"
# meets b"a" (no hits).
key_values = ["a", b"a", 1, ("a", 0)]
salts = st.sampled_from([None, "a", b"a"])  # each new request's tenant: equal prompts hit only within one
cache_keys = st.fixed_dictionaries({}, optional=dict(
    cache_salt=salts, adapter_key=st.sampled_from([None, *key_values]),
    extra_keys=st.dictionaries(st.integers(0, 4), st.sampled_from(key_values), max_size=2)))
_junk = itertools.count()


def kv_values(seq, end=None, drafts=()):
    """Position p's value depends on the salt and adapter, tokens[:p+1] and the extra keys of blocks up to p's,
    like real K/V (the salt stands for a tenant whose values no one else may read). Keys enter by repr:
    hash("a") == hash(b"a"), but they are different salts. ``drafts`` follow the tokens, as their K/V would."""
    values, running, bs = [], hash(repr((seq.cache_salt, seq.adapter_key))), seq.block_size
    for p, t in enumerate((seq.token_ids + list(drafts))[:end]):
        running = hash((running, t, repr(seq.extra_keys.get(p // bs)) if p % bs == 0 else None))
        values.append(running)
    return values


class StackPolicy(EvictionPolicy):
    """A user-written policy (most recently freed first), driven through the untrusted path."""

    def __init__(self):
        self._free = {}

    def add(self, block_id, cached):
        self._free[block_id] = None

    def remove(self, block_id):
        del self._free[block_id]

    def pop(self):
        if not self._free:
            raise OutOfBlocksError("empty")
        return self._free.popitem()[0]

    def __iter__(self):
        return iter(reversed(list(self._free)))

    def __len__(self):
        return len(self._free)


class PoolRules:
    """Rules and invariants every machine here shares: fork, free, swap, reset and speculative steps, with the
    engine's bookkeeping (``written``: verified positions with K/V, ``first_query``, ``reserved``, ``drafts``
    in flight, the ``running`` and ``swapped`` lists), ``_slots(seq, start, end)`` (the manager's slot lookup) and
    ``_step`` (writing a step's K/V). Hypothesis collects inherited rules and invariants."""

    def _copy(self, src_cache, dst_cache, pairs):
        """Apply the manager's (src, dst) block pairs to the fake caches, slot by slot (one flat list for a
        hybrid manager too: page ids are unique across groups)."""
        bs = self.manager.block_size
        for src, dst in pairs:
            for offset in range(bs):
                if src * bs + offset in src_cache:
                    dst_cache[dst * bs + offset] = src_cache[src * bs + offset]
                else:
                    dst_cache.pop(dst * bs + offset, None)

    def _undrafted(self, seqs=None):
        return [seq for seq in (self.running if seqs is None else seqs) if seq not in self.drafts]

    def _drafted(self):
        return [seq for seq in self.running if seq in self.drafts]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = Sequence([])
        self.manager.fork(parent, child)
        for book in (self.written, self.first_query, self.reserved, self.drafts):
            if parent in book:
                book[child] = book[parent]
        self.running.append(child)

    @precondition(lambda self: self._undrafted())
    @rule(data=st.data(), new=st.lists(tokens, max_size=3), drafts=st.lists(tokens, min_size=1, max_size=6),
          lookahead=st.integers(0, 2))
    def propose(self, data, new, drafts, lookahead):
        """A speculative step: the pending tokens plus ``new`` ones, then ``drafts`` after them."""
        seq = data.draw(st.sampled_from(self._undrafted()))
        for t in new:
            seq.append_token(t)
        k = len(drafts)
        if not self.manager.can_append_slots(seq, lookahead, num_draft_tokens=k):
            try:
                self.manager.append_slots(seq, lookahead, num_draft_tokens=k)
            except OutOfBlocksError:
                self.manager.free(seq, preempted=True)   # the engine would preempt it; we free it
                self._forget(seq)
                return
            raise AssertionError("append_slots succeeded although can_append_slots said no")
        first_query = self.written[seq]
        self._copy(self.gpu, self.gpu, self.manager.append_slots(seq, lookahead, num_draft_tokens=k))
        self.drafts[seq] = drafts
        self._step(seq, first_query, lookahead, drafts=drafts)
        self.history.append(seq.token_ids + drafts)

    @precondition(lambda self: self._drafted())
    @rule(data=st.data(), bonus=st.lists(tokens, max_size=1), bonus_first=st.booleans())
    def verify_drafts(self, data, bonus, bonus_first):
        """The verification pass accepted the first 1..all drafts (and maybe sampled a bonus token, which the
        engine may append before or after ``accept_drafts``)."""
        seq = data.draw(st.sampled_from(self._drafted()))
        self._verify(seq, data.draw(st.integers(1, len(self.drafts[seq]))), bonus, bonus_first)

    @precondition(lambda self: self._drafted())
    @rule(data=st.data(), bonus=st.lists(tokens, max_size=1), bonus_first=st.booleans())
    def reject_drafts(self, data, bonus, bonus_first):
        self._verify(data.draw(st.sampled_from(self._drafted())), 0, bonus, bonus_first)

    def _verify(self, seq, accepted, bonus, bonus_first):
        drafts = self.drafts.pop(seq)
        for t in drafts[:accepted] + (bonus if bonus_first else []):
            seq.append_token(t)
        self.manager.accept_drafts(seq, accepted)
        self.written[seq] += accepted
        for t in [] if bonus_first else bonus:
            seq.append_token(t)
        self.history.append(seq.token_ids)

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data(), preempted=st.booleans())
    def free(self, data, preempted):
        seq = data.draw(st.sampled_from(self.running + self.swapped))
        self.manager.free(seq, preempted=preempted)
        self._forget(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.running))
        if self.manager.can_swap_out(seq) is AllocStatus.OK:
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
        in_use = any(self.manager.ref_count(b) for b in range(self.manager.num_blocks))
        assert self.manager.reset_prefix_cache() == (not in_use)

    @invariant()
    def bookkeeping_is_consistent(self):
        self.manager.check_invariants()

    @invariant()
    def only_scheduled_positions_and_lookahead_have_slots(self):
        for seq in self.running + self.swapped:
            assert self.manager.num_scheduled_tokens(seq) == self.written[seq] + len(self.drafts.get(seq, ()))
            assert seq.num_draft_tokens == len(self.drafts.get(seq, ()))
        for seq in self.running:
            try:
                self._slots(seq, 0, self.reserved[seq] + 1)
            except InvalidArgumentError:
                continue
            raise AssertionError(f"seq {seq.seq_id}: a position without a slot got one")


class ManagerMachine(PoolRules, RuleBasedStateMachine):
    config = dict(num_blocks=24, block_size=4, num_cpu_blocks=12)

    def __init__(self):
        super().__init__()
        config = dict(self.config)
        if isinstance(config.get("eviction"), type):   # a policy class: a fresh instance per program
            config["eviction"] = config["eviction"]()
        self.manager = BlockManager(**config)
        self.window = self.manager.sliding_window
        self.gpu, self.cpu = {}, {}   # slot -> value: the engine's view of both caches
        self.running, self.swapped = [], []
        self.written = {}             # seq -> positions whose K/V the engine wrote
        self.reserved = {}            # seq -> positions with slots (written ones, drafts, lookahead slots)
        self.drafts = {}              # seq -> its draft tokens in flight (proposed, not verified yet)
        self.pass_hit = False         # whether the next admission passes a lookup's hit on
        self.first_query = {}         # seq -> first new position of its latest step
        self.history = []             # token lists of every sequence after each of its steps
        self.clock = 0

    # ---- the engine's side ---------------------------------------------------------------------------
    def _step(self, seq, first_query, lookahead=0, end=None, drafts=()):
        """Write the step's tokens first_query..end-1 (all of them by default, then the drafts'; and junk in
        lookahead slots), then check what its attention reads."""
        n, bs = seq.num_tokens if end is None else end, self.manager.block_size
        scheduled = n + len(drafts)
        assert self.manager.num_scheduled_tokens(seq) == scheduled
        values = kv_values(seq, drafts=drafts)
        slots = self.manager.slot_mapping(seq, first_query, scheduled + lookahead)
        for p, slot in enumerate(slots, first_query):
            assert slot >= 0, f"position {p} of the step has no slot"
            self.gpu[slot] = values[p] if p < scheduled else ("junk", next(_junk))
        self.written[seq], self.first_query[seq] = n, first_query
        self.reserved[seq] = max(self.reserved.get(seq, 0), scheduled + lookahead)
        assert len(seq.block_table) * bs >= scheduled + lookahead
        self._check_reads(seq, self._visible_from(first_query), n)

    def _slots(self, seq, start, end):
        return self.manager.slot_mapping(seq, start, end)

    def _visible_from(self, first_query):
        return 0 if self.window is None else max(0, first_query - self.window + 1)

    def _check_reads(self, seq, start, end):
        expected = kv_values(seq, end)
        for p, slot in enumerate(self.manager.slot_mapping(seq, start, end), start):
            assert slot >= 0, f"seq {seq.seq_id}: position {p} is still visible but was released"
            assert self.gpu.get(slot) == expected[p], f"seq {seq.seq_id} reads wrong K/V at position {p}"

    def _forget(self, seq):
        (self.running if seq in self.running else self.swapped).remove(seq)
        del self.written[seq], self.first_query[seq], self.reserved[seq]
        self.drafts.pop(seq, None)

    # ---- rules -----------------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, max_size=9), salt=salts)
    def allocate(self, prefix, suffix, salt):
        self._allocate(prefix + suffix or [0], cache_salt=salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), suffix=st.lists(tokens, max_size=3), salt=salts)
    def allocate_a_continuation(self, data, suffix, salt):
        """A new request that repeats part of an earlier sequence (the next turn of a chat): prefix hits, where
        the tenant is the same."""
        earlier = data.draw(st.sampled_from(self.history))
        self._allocate(earlier[:data.draw(st.integers(1, len(earlier)))] + suffix, cache_salt=salt)

    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), suffix=st.lists(tokens, max_size=9), salt=salts)
    def allocate_a_chunk(self, data, prefix, suffix, salt):
        """Admission of a prompt's first chunk: its prefix hits plus 1..all of its other tokens."""
        token_ids = prefix + suffix or [0]
        if self.history and data.draw(st.booleans()):   # or a continuation of an earlier sequence
            earlier = data.draw(st.sampled_from(self.history))
            token_ids = earlier[:data.draw(st.integers(1, len(earlier)))] + suffix[:3]
        self._allocate(token_ids, data, cache_salt=salt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), suffix=st.lists(tokens, max_size=3), changed=cache_keys)
    def allocate_with_cache_keys(self, data, suffix, changed):
        """A request of a tenant, or with an adapter or images: part of a running sequence again, with its salt
        and keys (hits) or with some of them ``changed`` (hits only on blocks whose keys still agree)."""
        earlier = data.draw(st.sampled_from(self.running))
        keys = {"cache_salt": earlier.cache_salt, "adapter_key": earlier.adapter_key,
                "extra_keys": dict(earlier.extra_keys), **changed}
        self._allocate(earlier.token_ids[:data.draw(st.integers(1, earlier.num_tokens))] + suffix, **keys)

    def _allocate(self, token_ids, data=None, **keys):
        """Admit a prompt with ``keys`` (salt, adapter, extra keys): all of it, or (drawing from ``data``) its
        hits and a first chunk of its other tokens."""
        seq = Sequence(token_ids, self.manager.block_size, **keys)
        # Every other admission passes one lookup's hit on, as the V1 scheduler does; the others look up inside.
        self.pass_hit = not self.pass_hit
        hit = self.manager.lookup(seq) if self.pass_hit else None
        cached = hit.num_tokens if hit else self.manager.get_num_cached_tokens(seq)   # the hits allocate will find
        num_new_tokens = None if data is None else data.draw(st.integers(1, seq.num_tokens - cached))
        if self.manager.can_allocate(seq, num_new_tokens=num_new_tokens, hit=hit) is not AllocStatus.OK:
            try:
                self.manager.allocate(seq, num_new_tokens=num_new_tokens, hit=hit)
            except OutOfBlocksError:
                return
            raise AssertionError("allocate succeeded although can_allocate said it would not fit")
        admitted = self.manager.allocate(seq, num_new_tokens=num_new_tokens, hit=hit)
        self._copy(self.gpu, self.gpu, admitted.copies)  # a partial-block hit's units (prefix_match_unit)
        assert seq.num_cached_tokens == cached < seq.num_tokens
        self.history.append(seq.token_ids)
        self.running.append(seq)
        end = None if num_new_tokens is None else seq.num_cached_tokens + num_new_tokens
        self._step(seq, seq.num_cached_tokens, end=end)

    @precondition(lambda self: self._undrafted(self.running + self.swapped))
    @rule(data=st.data(), new=st.lists(tokens, min_size=1, max_size=9))
    def append_tokens(self, data, new):
        """Tokens sampled (or a chunk) that get their slots in a later step."""
        seq = data.draw(st.sampled_from(self._undrafted(self.running + self.swapped)))
        for t in new:
            seq.append_token(t)

    @precondition(lambda self: self._undrafted())
    @rule(data=st.data(), new=st.lists(tokens, max_size=9), lookahead=st.integers(0, 3))
    def step(self, data, new, lookahead):
        """One engine step for a sequence: its pending tokens plus ``new`` ones get slots and K/V."""
        seq = data.draw(st.sampled_from(self._undrafted()))
        for t in new:
            seq.append_token(t)
        if not self.manager.can_append_slots(seq, lookahead):
            try:
                self.manager.append_slots(seq, lookahead)
            except OutOfBlocksError:
                self._forget(seq)   # the engine would preempt it; we free it
                self.manager.free(seq, preempted=True)
                return
            raise AssertionError("append_slots succeeded although can_append_slots said no")
        self._copy(self.gpu, self.gpu, self.manager.append_slots(seq, lookahead))
        self._step(seq, self.written[seq], lookahead)
        self.history.append(seq.token_ids)

    @precondition(lambda self: any(self.written[seq] < seq.num_tokens for seq in self._undrafted()))
    @rule(data=st.data(), lookahead=st.integers(0, 3))
    def step_a_chunk(self, data, lookahead):
        """One engine step for the next 1..all tokens without a slot (the rest of a chunked prompt, or tokens
        appended since the last step)."""
        seq = data.draw(st.sampled_from([seq for seq in self._undrafted() if self.written[seq] < seq.num_tokens]))
        first_query = self.written[seq]
        k = data.draw(st.integers(1, seq.num_tokens - first_query))
        if not self.manager.can_append_slots(seq, lookahead, num_new_tokens=k):
            try:
                self.manager.append_slots(seq, lookahead, num_new_tokens=k)
            except OutOfBlocksError:
                self._forget(seq)   # the engine would preempt it; we free it
                self.manager.free(seq, preempted=True)
                return
            raise AssertionError("append_slots succeeded although can_append_slots said no")
        self._copy(self.gpu, self.gpu, self.manager.append_slots(seq, lookahead, num_new_tokens=k))
        self._step(seq, first_query, lookahead, end=first_query + k)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def touch(self, data):
        self.clock += 1
        self.manager.touch(data.draw(st.sampled_from(self.running)), self.clock)

    # ---- invariants ------------------------------------------------------------------------------------
    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        for seq in self.running:
            n = self.written[seq]
            expected = kv_values(seq, n)
            visible = self._visible_from(self.first_query[seq])
            for p, slot in enumerate(self.manager.slot_mapping(seq, 0, n)):
                assert slot >= 0 or p < visible, f"seq {seq.seq_id}: position {p} released while visible"
                if slot >= 0:
                    assert self.gpu.get(slot) == expected[p], f"seq {seq.seq_id} position {p} reads wrong K/V"


def _machine(name, **config):
    return type(name, (ManagerMachine,), {"config": config})


MACHINES = [
    _machine("Default", num_blocks=24, block_size=4, num_cpu_blocks=12),
    _machine("ConstantHash", num_blocks=24, block_size=2, num_cpu_blocks=12, hash_fn=lambda parent, ids: 7),
    _machine("ParityHash", num_blocks=20, block_size=3, num_cpu_blocks=8,
             hash_fn=lambda parent, ids: sum(ids) % 2),
    _machine("Window5", num_blocks=16, block_size=2, num_cpu_blocks=12, sliding_window=5),
    _machine("Window2", num_blocks=16, block_size=4, num_cpu_blocks=8, sliding_window=2),
    _machine("Window1ConstantHash", num_blocks=16, block_size=3, num_cpu_blocks=8, sliding_window=1,
             hash_fn=lambda parent, ids: 7),
    _machine("FIFO", num_blocks=16, block_size=2, num_cpu_blocks=8, eviction="fifo"),
    _machine("LFUWindow3", num_blocks=16, block_size=2, num_cpu_blocks=8, eviction="lfu", sliding_window=3),
    _machine("UserPolicy", num_blocks=16, block_size=2, num_cpu_blocks=8, eviction=StackPolicy),
    _machine("Eagle", num_blocks=20, block_size=2, num_cpu_blocks=8, use_eagle=True),
    _machine("NoPrefixCaching", num_blocks=20, block_size=3, num_cpu_blocks=8, enable_prefix_caching=False),
    # prefix_match_unit: partial-block hits, whose units are copied into a new block at admission
    _machine("Units", num_blocks=24, block_size=4, num_cpu_blocks=12, prefix_match_unit=1),
    _machine("Units2FIFO", num_blocks=16, block_size=6, num_cpu_blocks=8, prefix_match_unit=2, eviction="fifo"),
    _machine("UnitsUserPolicy", num_blocks=16, block_size=3, num_cpu_blocks=8, prefix_match_unit=1,
             eviction=StackPolicy),
]

# max_examples comes from the Hypothesis profile; a soak can also lengthen every program.
STEPS = int(os.environ.get("KVLAB_STATEFUL_STEPS", "40"))
for _machine_class in MACHINES:
    _case = _machine_class.TestCase
    _case.settings = settings(stateful_step_count=STEPS, deadline=None)
    globals()[f"Test{_machine_class.__name__}"] = _case
del _case
