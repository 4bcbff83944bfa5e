"""Puzzle: an eviction policy, kvlab's LRU. Read first: notebook 02 (§4, eviction order).

**Spec.** A block whose reference count drops to 0 is *free*; if it still holds a prefix the cache can hit, it
is free *and cached*. The eviction policy owns the set of free blocks and decides which one the pool reuses
next (``kvlab.blocks.eviction``). Write ``MyLRU``, the order of kvlab's ``"lru"``:

* blocks that were added not cached are reused first, in the order they were added (oldest first);
* then the cached ones, least recently freed first (added first, reused first);
* ``add(block_id, cached)``: the block became free; ``remove(block_id)``: a free block leaves the set without
  being reused (a prefix hit took it back); ``pop()``: take out and return the next block to reuse (raise
  ``kvlab.errors.OutOfBlocksError`` when there is none); ``__iter__``: the free blocks in the order ``pop``
  would return them; ``__len__``: how many there are.

Every call must cost O(1): no scan of the free blocks, no ``list.remove`` (hint: ``collections.OrderedDict``).
The manager tells the policy about every change; a sequence frees its blocks tail first, so a prompt's shared
head outlives its tail.

``check(MyLRU)`` runs the same random workload (prompts sharing prefixes, growth, frees) on a
``BlockManager(eviction=MyLRU())`` and on one with kvlab's LRU, and compares the free blocks' order and the
block tables after every operation. Then two cases on your policy alone: ``pop()`` on an empty free set, and
the O(1) rule (with hundreds of free blocks, no call may compare or hash more than a few block ids: a scan of
the free blocks, as ``list.remove`` or ``in`` on a list does, touches them all).
"""

import random
from itertools import chain

from kvlab.blocks import BlockManager, EvictionPolicy, Sequence
from kvlab.errors import OutOfBlocksError
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded

NAME = "lru_policy"
OPS_PER_POOL = 25
NUM_FREE_FOR_O1 = 400  # free blocks in the O(1) case
MAX_TOUCHES = 8        # block ids one O(1) call may compare or hash (a dict operation hashes one)


class MyLRU(EvictionPolicy):
    """kvlab's LRU order (see the module docstring). Your code here."""

    def __init__(self):
        pass

    def add(self, block_id: int, cached: bool) -> None:
        raise NotImplementedError

    def remove(self, block_id: int) -> None:
        raise NotImplementedError

    def pop(self) -> int:
        raise NotImplementedError

    def __iter__(self):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


def check(policy_class, *, strict: bool = False, seed: int = 0, num_cases: int = 200) -> Report:
    """Replay ``num_cases`` random operations (from ``seed``) on a manager using ``policy_class()`` and on one
    using kvlab's LRU (the first operation after which they differ is the failing case), then the empty pop and
    the O(1) rule on ``policy_class()`` alone."""
    rng = seeded(seed, num_cases)
    cases = chain(_cases(rng, num_cases), (_empty_pop_case(), _constant_time_case()))
    return grade(NAME, policy_class, cases, num_cases=num_cases + 2, strict=strict)


class _Twins:
    """kvlab's manager, and the learner's built at its first case (building it calls the policy); each keeps
    its running sequences in the same order (twins: the same tokens, one sequence per manager)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kvlab, self.running = BlockManager(num_blocks, block_size, eviction="lru"), []
        self.theirs, self.their_running = None, []

    def learner(self, policy_class) -> BlockManager:
        if self.theirs is None:
            self.theirs = BlockManager(self.num_blocks, self.block_size, eviction=policy_class())
        return self.theirs


def _cases(rng: random.Random, num_cases: int):
    made = 0
    while made < num_cases:
        bs = rng.choice((2, 4))
        twins = _Twins(rng.randint(8, 24), bs)
        prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 3) * bs)] for _ in range(3)]
        for _ in range(min(OPS_PER_POOL, num_cases - made)):
            yield _operation(rng, twins, prefixes)
            made += 1


def _operation(rng, twins: _Twins, prefixes) -> Case:
    """Do one random operation on kvlab's manager; the case does it on the learner's and compares."""
    manager, bs, running = twins.kvlab, twins.block_size, twins.running
    choice = rng.random()
    if running and choice < 0.35:  # a sequence finishes
        i = rng.randrange(len(running))
        seq = running.pop(i)
        manager.free(seq)
        what = f"sequence {i} of the running ones ({seq.num_tokens} tokens) finishes"

        def act(theirs):
            theirs.free(twins.their_running.pop(i))
    elif running and choice < 0.6:  # a sequence grows
        i = rng.randrange(len(running))
        new = [rng.randrange(1000) for _ in range(rng.randint(1, bs))]
        grows = _grow(manager, running[i], new)
        what = f"sequence {i} of the running ones grows by {len(new)} tokens" + ("" if grows else " (no room)")

        def act(theirs):
            _grow(theirs, twins.their_running[i], new, grows)
    else:  # a prompt arrives, maybe sharing a prefix with earlier ones
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(0, 2 * bs))]
        seq = Sequence(prompt, bs)
        admitted = bool(manager.can_allocate(seq))
        if admitted:
            manager.allocate(seq)
            running.append(seq)
        what = f"a prompt of {len(prompt)} tokens arrives" + (
            f" ({seq.num_cached_tokens} of them hit the cache)" if admitted else " (no room: it waits)")

        def act(theirs):
            if admitted:
                twins.their_running.append(Sequence(prompt, bs))
                theirs.allocate(twins.their_running[-1])
    free = manager.free_block_ids()
    cached = {block for block in free if manager.is_cached(block)}
    tables = [manager.get_block_table(seq) for seq in running]

    def run(policy_class):
        theirs = twins.learner(policy_class)
        act(theirs)
        return theirs.free_block_ids(), [theirs.get_block_table(seq) for seq in twins.their_running]
    return Case(f"a pool of {twins.num_blocks} blocks of {bs} tokens; {what}", run,
                lambda got: _judge(free, cached, tables, got))


def _empty_pop_case() -> Case:
    def run(policy_class):
        policy = policy_class()
        policy.add(3, False)
        policy.add(5, True)
        policy.pop()
        policy.pop()
        try:
            return f"returned {policy.pop()!r}"
        except OutOfBlocksError:
            return "raised OutOfBlocksError"
        except Exception as error:  # noqa: BLE001 - the wrong exception is the answer to judge
            return f"raised {type(error).__name__}: {error}"
    return Case("a policy given blocks 3 (not cached) and 5 (cached), popped twice, then popped once more", run,
                lambda got: None if got == "raised OutOfBlocksError" else
                f"pop() on an empty free set must raise kvlab.errors.OutOfBlocksError (the pool and the scheduler "
                f"catch it), yours {got}")


class _CountedId(int):
    """A block id that counts how often a policy compares or hashes it (``touches``, over every id)."""
    touches = 0

    def __eq__(self, other):
        _CountedId.touches += 1
        return int(self) == other

    def __hash__(self):
        _CountedId.touches += 1
        return int.__hash__(self)


def _constant_time_case() -> Case:
    def run(policy_class):
        policy, ids = policy_class(), [_CountedId(i) for i in range(NUM_FREE_FOR_O1)]
        calls = [("add", lambda b=b: policy.add(b, b % 2 == 0)) for b in ids]
        calls += [("remove", lambda b=b: policy.remove(b)) for b in ids[NUM_FREE_FOR_O1 // 2::7]]
        calls += [("pop", policy.pop)] * (NUM_FREE_FOR_O1 // 4)
        worst = (0, "")
        for name, call in calls:
            _CountedId.touches = 0
            returned = call()
            worst = max(worst, (_CountedId.touches, f"{name}({returned if name == 'pop' else ''})"))
        return list(worst)
    return Case(f"{NUM_FREE_FOR_O1} blocks added, some removed from the middle, a quarter popped", run,
                lambda got: None if got[0] <= MAX_TOUCHES else
                f"{got[1] or 'a call'} compared or hashed {got[0]} block ids, with hundreds of blocks free: it scans "
                f"the free blocks (list.remove, `in` on a list, a loop); every call must cost O(1), at most "
                f"{MAX_TOUCHES} here (hint: collections.OrderedDict)")


def _grow(manager, seq, tokens, room=None) -> bool:
    """Append ``tokens`` to ``seq`` and schedule them if there is room (``room``: known already)."""
    for token in tokens:
        seq.append_token(token)
    if room is None:
        room = manager.can_append_slots(seq)
    if room:
        manager.append_slots(seq)
    return room


def _judge(free, cached, tables, got):
    their_free, their_tables = got
    if not same(their_free, free):
        wrong = not_an_int(their_free)
        if wrong:
            why = f": {wrong}"
        else:
            extra, missing = sorted(set(their_free) - set(free)), sorted(set(free) - set(their_free))
            why = (f": blocks {extra} are in use, not free (a prefix hit takes a free block back through remove)"
                   if extra else f": blocks {missing} are free but missing from yours" if missing else "")
        marked = ", ".join(f"{block}{' (cached)' if block in cached else ''}" for block in free)
        return (f"the free blocks in reuse order should be [{marked}] (never-cached first, oldest first; then "
                f"cached, least recently freed first), yours are {their_free}{why}")
    if not same(their_tables, tables):
        return f"the running sequences' block tables should be {tables}, yours are {their_tables}"
    return None
