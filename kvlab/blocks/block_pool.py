"""The GPU pool: reference counts, the free blocks' reuse order (an eviction policy, kvlab.blocks.eviction)
and its prefix index, with the transaction that makes a call's policy calls undoable.
"""

from collections import Counter
from contextlib import contextmanager, nullcontext
from functools import partial
from operator import itemgetter
from typing import Optional

from kvlab.blocks.events import EventSink
from kvlab.blocks.eviction import BUILTIN_POLICIES, EvictionPolicy
from kvlab.blocks.prefix_cache import Evicted, PrefixIndex, ROOT
from kvlab.errors import EvictionPolicyError, InvariantViolation, KvlabError
from kvlab.validation import is_int


# ==== the undoable policy transaction =================================================================================
# Calls into the eviction policy that can be taken back.
#
# The eviction policy may be user code, and any of its methods may raise. So every operation of the manager
# makes all of its policy calls first, through one ``PolicyTransaction``, and only then changes its own
# bookkeeping (which cannot fail). When a policy call raises, the calls that already succeeded are undone in
# reverse order and ``EvictionPolicyError`` is raised: the free set holds exactly the blocks it held before
# and nothing else changed. (What a policy keeps privately, such as hit counts or the place of an undone
# block in its order, is its own business.)
#
# kvlab's own policies never raise on a valid call, so their fast batch methods are called directly and
# nothing is journaled (``TrustedCalls``). Any other policy is driven one block at a time (its batch methods are
# documented to equal those loops), so that exactly the calls that succeeded are undone, and every block it hands
# out is checked (``PolicyTransaction``).

class _ListenerCalls:
    """What every transaction does alike: tell a listening policy of prefix hits and of accesses."""
    calling = ""  # the policy method being called, for the error message

    def hits(self, blocks) -> None:
        listener = self._pool.hit_listener
        if listener is not None:
            self.calling = "on_hit"
            for block in blocks:
                listener(block)

    def access(self, blocks, now) -> None:
        listener = self._pool.access_listener
        if listener is not None:
            self.calling = "on_access"
            for block in blocks:
                listener(block, now)


class TrustedCalls(_ListenerCalls):
    """The transaction of a kvlab policy: ``revive(blocks)``, ``pop(count)`` and ``add(blocks, cached)`` are the
    policy's own ``remove_many``, ``pop_many`` and ``add_many``, called as they are (nothing to undo)."""

    def __init__(self, pool):
        self._pool, policy = pool, pool.policy
        self.revive, self.pop, self.add = policy.remove_many, policy.pop_many, policy.add_many


class PolicyTransaction(_ListenerCalls):
    def __init__(self, pool):
        self._pool = pool
        self._policy = pool.policy
        self._undo = []   # (method, blocks, cached flags) that reverses each successful call
        self._seen = set()  # blocks popped or revived in this transaction (checks an untrusted policy)
        self._added = set()  # blocks freed in this transaction: free, though their counts drop only after it

    def revive(self, blocks) -> None:
        """Free blocks leave the free set without being reused (prefix hits take them back)."""
        warm, remove = self._pool.index.warm, self._policy.remove
        self.calling = "remove"
        for block in blocks:
            remove(block)
            self._undo.append(("add", [block], [warm[block]]))
            self._seen.add(block)

    def pop(self, count: int) -> list:
        """``count`` free blocks to reuse, in the policy's order."""
        warm = self._pool.index.warm
        self.calling = "pop"
        taken = []
        for _ in range(count):
            block = self._policy.pop()
            self._check_popped(block)
            self._undo.append(("add", [block], [warm[block]]))
            taken.append(block)
        return taken

    def add(self, blocks, cached) -> None:
        """``blocks`` become free; ``cached[i]`` says whether block i holds a hittable prefix."""
        self.calling = "add"
        for block, is_cached in zip(blocks, cached):
            self._policy.add(block, is_cached)
            self._undo.append(("remove", [block], None))
            self._added.add(block)

    def rollback(self) -> None:
        policy = self._policy
        for method, blocks, cached in reversed(self._undo):
            if method == "add":
                for block, is_cached in zip(blocks, cached):
                    policy.add(block, is_cached)
            else:
                for block in blocks:
                    policy.remove(block)
        self._undo.clear()

    def _check_popped(self, block) -> None:
        pool = self._pool
        if not (is_int(block) and pool.first_block <= block < pool.num_blocks
                and (not pool.ref[block] or block in self._added) and block not in self._seen):
            raise EvictionPolicyError(f"pop() returned {block!r}, which is not a free block of this pool")
        self._seen.add(block)


@contextmanager
def policy_transaction(pool):
    """``with policy_transaction(pool) as txn:`` make the operation's policy calls; on any exception they
    are undone and an EvictionPolicyError (chained to the cause) is raised."""
    txn = PolicyTransaction(pool)
    try:
        yield txn
    except BaseException as error:
        name = type(pool.policy).__name__
        try:
            txn.rollback()
        except Exception as again:
            raise EvictionPolicyError(
                f"{name}.{txn.calling} raised {type(error).__name__}: {error}; undoing the calls before it "
                f"raised {type(again).__name__}: {again}. The manager's records are unchanged, but the policy's "
                "free set may not be: check_invariants() will say") from error
        if isinstance(error, KvlabError) or not isinstance(error, Exception):
            raise  # our own check failed (already explained), or KeyboardInterrupt & co.
        raise EvictionPolicyError(f"{name}.{txn.calling} raised {type(error).__name__}: {error}; the "
                                  "operation was undone and the manager is unchanged") from error


# ==== the GPU pool ====================================================================================================
# The GPU pool: fixed-size blocks with reference counts, the free blocks' reuse order, and its prefix index.
#
# Per-block state lives in parallel lists indexed by block id (cheaper than an object per block, and every
# operation below is O(1) in the pool size). A block is in exactly one of two states:
#     used: ref_count > 0, referenced by that many block-table entries;
#     free: ref_count == 0, owned by the eviction policy, which decides the reuse order.
# What each block holds (sealed content, hittable or not) is the pool's ``PrefixIndex``'s business
# (kvlab.blocks.prefix_cache: lookup, seal, evict): a free cached block is "warm": a hit takes it back, reusing
# it for new content evicts it from the index, and the pool reports what was evicted to its sink.
#
# Changing a block's state takes two calls: the policy side first, inside ``transaction()`` (user code that
# may fail and is undone), then the bookkeeping side (``fill``, ``claim``, ``drop``), which cannot fail.

class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy, first_block: int, sink: Optional[EventSink],
                 index: Optional[PrefixIndex] = None):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.index = index if index is not None else PrefixIndex(num_blocks)  # what each block holds
        self.policy = policy
        # Only policies that listen get called; skipping the no-op keeps hits cheap for the rest.
        self.hit_listener = policy.on_hit if type(policy).on_hit is not EvictionPolicy.on_hit else None
        self.access_listener = (policy.on_access if type(policy).on_access is not EvictionPolicy.on_access
                                else None)
        self.first_block = first_block    # blocks below it are reserved (the sliding window's null block)
        self.num_free = num_blocks - first_block  # the pool's own count: never trusts len(policy)
        self.sink = sink  # the manager's EventSink (kvlab.blocks.events), None when nobody listens
        self.tier = None  # the OffloadTier evicted blocks are offered to (kvlab.blocks.tiers), if any
        self.evictions = 0
        # ``with pool.transaction() as txn:`` the policy calls of one operation, undone if one raises (a kvlab
        # policy never raises on a valid call: its calls go straight to it).
        self.transaction = (partial(nullcontext, TrustedCalls(self)) if type(policy) in BUILTIN_POLICIES
                            else partial(policy_transaction, self))
        policy.add_many(list(range(first_block, num_blocks)), [False] * self.num_free)

    def freed_by(self, blocks) -> tuple[list[int], list[bool]]:
        """The blocks of ``blocks`` (distinct) that ``drop(blocks)`` would free, in order, and whether each is
        cached (the flags the policy wants). Pure."""
        ref, warm = self.ref, self.index.warm
        freed = [block for block in blocks if ref[block] == 1]
        if len(freed) < 2:
            return freed, [warm[block] for block in freed]
        return freed, list(itemgetter(*freed)(warm))

    def release(self, blocks) -> list[int]:
        """One reference less to each of ``blocks`` (distinct), when that is the operation's only policy call:
        the freed ones go to the policy, then the counts change. Returns the freed blocks."""
        freed, cached = self.freed_by(blocks)
        with self.transaction() as txn:
            txn.add(freed, cached)
        self.drop(blocks, freed)
        return freed

    # ---- bookkeeping, after the transaction made the policy calls ----------------------------------------
    def fill(self, taken, hashes=(), contents=(), parent: int = ROOT, group: int = 0) -> int:
        """Blocks the policy handed out for new content: ref count 1 each, their old prefixes evicted from the
        index (reported to the sink: each block, its hash and its bytes; then offered to the offload tier, if
        any); the first ``len(hashes)`` are full with ``contents[i]``, chained after the prefix whose content id
        is ``parent``, and sealed in KV cache ``group`` (see ``seal``). Returns the content id the next block
        chains after."""
        ref, index = self.ref, self.index
        for block in taken:
            ref[block] = 1
        evicted = index.evict(taken, len(hashes))  # the first len(hashes) are sealed again below
        if evicted is not None:
            self._evicted(evicted)
            if self.tier is not None:
                self.tier.offer(evicted)
        self.num_free -= len(taken)
        return self.seal(taken[:len(hashes)], hashes, contents, parent, group) if hashes else parent

    def unseal(self, blocks) -> None:
        """``blocks`` (each in use by the one sequence about to overwrite it) stop holding sealed content: the
        cached ones leave the index, reported to the sink as evicted (kvlab.blocks.group_manager); never offered to the
        offload tier, which keeps free cached blocks the pool reuses."""
        evicted = self.index.evict(blocks)
        if evicted is not None:
            self._evicted(evicted)

    def _evicted(self, evicted: Evicted) -> None:
        self.evictions += len(evicted.slots)
        if self.sink is not None:
            self.sink.evicted(evicted.slots, evicted.hashes, evicted.contents)

    def claim(self, blocks, revived: int) -> None:
        """One more reference to each block (prefix hits, forks, twins); ``revived`` of them were free."""
        ref = self.ref
        for block in blocks:
            ref[block] += 1
        self.num_free -= revived

    def drop(self, blocks, freed) -> None:
        """One reference less to each block; ``freed`` (from ``freed_by(blocks)``) went to the policy already."""
        ref = self.ref
        for block in blocks:
            ref[block] -= 1
        self.num_free += len(freed)
        if self.sink is not None and freed:
            self.sink.released(freed)

    def seal(self, blocks, hashes, contents, parent: int, group: int = 0) -> int:
        """Seal ``blocks`` in the index (``PrefixIndex.seal``, in KV cache ``group``'s namespace) and report those
        with new content to the sink (a duplicate of a cached prefix has none). Returns the content id the next
        block chains after."""
        first_new = self.index.ids.next
        parent = self.index.seal(blocks, hashes, contents, parent, group)
        if self.sink is not None and self.index.ids.interned is not None:  # ids interned across managers:
            self.sink.sealed([b for b in blocks if self.index.registered[b]])  # those not twins of a cached one
        elif self.sink is not None:
            content = self.index.content
            self.sink.sealed(blocks if self.index.ids.next - first_new == len(blocks) else
                             [b for b in blocks if content[b] >= first_new])
        return parent

    def check(self, table_refs: Counter) -> None:
        """Raise InvariantViolation unless the pool agrees with ``table_refs`` (block -> table entries using
        it, counted by the manager), with its index and with itself. O(pool size)."""
        for block in range(self.num_blocks):
            if self.ref[block] != table_refs.get(block, 0):
                _fail(f"GPU block {block}: ref count {self.ref[block]}, but {table_refs.get(block, 0)} table "
                      "entries use it")
        if any(self.ref[b] for b in range(self.first_block)):
            _fail("the reserved null block must never be referenced")
        free = list(self.policy)
        if len(free) != len(set(free)) or len(free) != len(self.policy) or len(free) != self.num_free:
            _fail(f"the free set lists a block twice or miscounts ({len(free)} listed, {len(self.policy)} by "
                  f"len(), {self.num_free} counted by the pool)")
        expected_free = {b for b in range(self.first_block, self.num_blocks) if self.ref[b] == 0}
        if set(free) != expected_free:
            _fail(f"free set {sorted(set(free) ^ expected_free)[:10]}... disagrees with ref counts "
                  "(a block must be free xor used)")
        self.index.check()
        misfiled = [b for b in free if self.policy.filed_as_cached(b) not in (None, self.index.warm[b])]
        if misfiled:
            _fail(f"free blocks {misfiled[:10]} are filed as cached/uncached against the prefix cache map")


def _fail(message: str):
    raise InvariantViolation(message)
