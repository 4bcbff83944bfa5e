"""Calls into the eviction policy that can be taken back.

The eviction policy may be user code, and any of its methods may raise. So every operation of the manager
makes all of its policy calls first, through one ``PolicyTransaction``, and only then changes its own
bookkeeping (which cannot fail). When a policy call raises, the calls that already succeeded are undone in
reverse order and ``EvictionPolicyError`` is raised: the free set holds exactly the blocks it held before
and nothing else changed. (What a policy keeps privately, such as hit counts or the place of an undone
block in its order, is its own business.)

kvlab's own policies never raise on a valid call, so their fast batch methods are used as they are and
nothing is journaled. Any other policy is driven one block at a time (its batch methods are documented to
equal those loops), so that exactly the calls that succeeded are undone, and every block it hands out is
checked.
"""

from contextlib import contextmanager

from kvlab.blocks.eviction import BUILTIN_POLICIES
from kvlab.errors import EvictionPolicyError, KvlabError
from kvlab.validation import is_int


class PolicyTransaction:
    def __init__(self, pool):
        self._pool = pool
        self._policy = pool.policy
        self._trusted = type(pool.policy) in BUILTIN_POLICIES
        self._undo = []   # (method, blocks, cached flags) that reverses each successful call
        self._seen = set()  # blocks popped or revived in this transaction (checks an untrusted policy)
        self._added = set()  # blocks freed in this transaction: free, though their counts drop only after it
        self.calling = ""   # the policy method being called, for the error message

    def revive(self, blocks) -> None:
        """Free blocks leave the free set without being reused (prefix hits take them back)."""
        registered, remove = self._pool.index.registered, self._policy.remove
        self.calling = "remove"
        for block in blocks:
            remove(block)
            if not self._trusted:
                self._undo.append(("add", [block], [registered[block]]))
                self._seen.add(block)

    def pop(self, count: int) -> list:
        """``count`` free blocks to reuse, in the policy's order."""
        if not count:
            return []
        if self._trusted:  # nothing in a transaction with a trusted policy can fail: no undo to record
            self.calling = "pop_many"
            return self._policy.pop_many(count)
        registered = self._pool.index.registered
        self.calling = "pop"
        taken = []
        for _ in range(count):
            block = self._policy.pop()
            self._check_popped(block)
            self._undo.append(("add", [block], [registered[block]]))
            taken.append(block)
        return taken

    def add(self, blocks, cached) -> None:
        """``blocks`` become free; ``cached[i]`` says whether block i holds a hittable prefix."""
        if not blocks:
            return
        if self._trusted:
            self.calling = "add_many"
            self._policy.add_many(blocks, cached)
            return
        self.calling = "add"
        for block, is_cached in zip(blocks, cached):
            self._policy.add(block, is_cached)
            self._undo.append(("remove", [block], None))
            self._added.add(block)

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
