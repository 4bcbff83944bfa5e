"""Which entry the CPU offload tier drops when it needs a slot, and which evicted GPU blocks it admits.

Replacement (``offload_policy``), over the hashes the tier holds:
    "lru"  least recently stored or hit first (vLLM's ``LRUOffloadingManager``);
    "arc"  Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as vLLM's ``ARCOffloadingManager``: T1 holds
           entries hit once since they were stored, T2 those hit again; B1 / B2 remember (hashes only) what
           was dropped from each. A lookup that would have hit B1 says recency was undervalued (T1's target
           grows), one in B2 says frequency was (it shrinks); the victim comes from T1 while T1 is at or above
           its target, else from T2. The ghost lists are bounded by the tier's size.
Admission (``offload_admission``):
    "always"  every evicted cached GPU block is offered to the tier;
    "reused"  only blocks whose hash ``allocate`` looked up at least ``REUSE_THRESHOLD`` times (vLLM's
              ``FilterReusedOffloadingManager``, counting in a bounded LRU table). vLLM stores a block when
              it is computed and counts the hashes its connector looks up past the GPU's hits; kvlab offloads
              at GPU eviction, so it counts every full block of every prompt ``allocate`` looks up (a block
              hit on the GPU was reused too).

Every call but ``LRUOrder.victim`` (see there) is O(1) per hash; ``make_room`` takes a batch of GPU evictions at
once (kvlab.blocks.offload_tier). ``touch`` takes the hashes in prompt order and visits them last to
first, as vLLM does, so a prompt's first block ends up most recently used.
"""

from collections import OrderedDict, deque
from itertools import filterfalse, islice

from kvlab.errors import InvalidArgumentError, InvariantViolation

REUSE_THRESHOLD = 2


class LRUOrder:
    """The tier's hashes, least recently used first. A plain dict, not an OrderedDict: its insertions cost about
    half as much, and a use moves a hash to the end by taking it out and putting it back. The price: ``victim``
    walks past the dict's deleted slots at its front, so a batch ``make_room`` cannot take is halved
    (kvlab.blocks.offload_tier) rather than looped, and ``victim`` runs for single blocks only."""

    split_batches = True  # the offload tier halves a batch make_room refuses instead of looping over it

    def __init__(self, capacity: int):
        self.entries: dict = {}

    def insert(self, block_hash) -> None:
        self.entries[block_hash] = None

    def touch(self, hashes) -> None:
        entries = self.entries
        for block_hash in filter(entries.__contains__, reversed(hashes)):  # most hashes miss: filtered in C
            entries[block_hash] = entries.pop(block_hash)

    def make_room(self, num_victims: int, hashes, resident, pinned=frozenset()) -> list | None:
        """What ``victim(pinned)`` for each of the last ``num_victims`` of ``hashes``, each followed by
        ``insert`` of its hash, after ``insert`` of the others, would do, done at once: returns the victims in
        order. None, changing nothing, where that would drop an entry of this batch or one of ``resident``
        (hashes the batch skipped as held, which the one-by-one loop would store again once dropped)."""
        entries = self.entries
        if num_victims > len(entries):
            return None
        candidates = filterfalse(pinned.__contains__, entries) if pinned else entries
        victims = list(islice(candidates, num_victims))
        if len(victims) < num_victims or (resident and not resident.isdisjoint(victims)):
            return None
        deque(map(entries.__delitem__, victims), 0)
        entries.update(dict.fromkeys(hashes))
        return victims

    def victim(self, pinned) -> object:
        """Remove and return the entry to drop (never one of ``pinned``), or None if every entry is pinned."""
        entries = self.entries
        for block_hash in entries:
            if block_hash not in pinned:
                del entries[block_hash]
                return block_hash
        return None

    def clear(self) -> None:
        self.entries.clear()

    def resident(self) -> list:
        return list(self.entries)

    def check(self) -> None:
        pass


class ARCOrder:
    """T1 / T2 (resident hashes, least recent first) and their ghost lists B1 / B2, with T1's adaptive target."""

    split_batches = False  # OrderedDicts: ``victim`` is O(1), the one-by-one loop takes a batch make_room refuses

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target_t1 = 0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def insert(self, block_hash) -> None:
        self.t1[block_hash] = None
        self.b1.pop(block_hash, None)
        self.b2.pop(block_hash, None)

    def touch(self, hashes) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for block_hash in reversed(hashes):
            if block_hash in t1:
                del t1[block_hash]
                t2[block_hash] = None
            elif block_hash in t2:
                t2.move_to_end(block_hash)
            elif block_hash in b1:
                self.target_t1 = min(self.target_t1 + max(1, len(b2) // len(b1)), self.capacity)
            elif block_hash in b2:
                self.target_t1 = max(self.target_t1 - max(1, len(b1) // len(b2)), 0)

    def make_room(self, num_victims: int, hashes, resident, pinned=frozenset()) -> list | None:
        """As ``LRUOrder.make_room``. Victims come from T1 while T1 (which each insert grows) is at or above its
        target, else from T2, never ``pinned``; done at once only where that is exact: no new hash is a ghost (an
        insert would remove it from B1/B2 between two victims' appends), every victim is an entry from before
        the batch, and none is ``resident``."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if not (b1.keys().isdisjoint(hashes) and b2.keys().isdisjoint(hashes)):
            return None
        length = len(t1) + len(hashes) - num_victims  # T1's length when the first victim is chosen
        from_t2 = min(num_victims, max(0, self.target_t1 - length))
        from_t1 = num_victims - from_t2
        unpinned = (lambda part: filterfalse(pinned.__contains__, part)) if pinned else iter
        victims = list(islice(unpinned(t2), from_t2)) + list(islice(unpinned(t1), from_t1))
        if len(victims) < num_victims or (resident and not resident.isdisjoint(victims)):
            return None
        for resident_list, ghosts, dropped in ((t2, b2, victims[:from_t2]), (t1, b1, victims[from_t2:])):
            deque(map(resident_list.__delitem__, dropped), 0)
            ghosts.update(dict.fromkeys(dropped))
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        t1.update(dict.fromkeys(hashes))
        return victims

    def victim(self, pinned) -> object:
        """From T1 while it is at or above its target (falling back to T2), else from T2: the least recent entry
        not ``pinned``, remembered in that list's ghost list. None if every candidate is pinned."""
        if len(self.t1) >= self.target_t1:
            block_hash = self._drop_oldest(self.t1, self.b1, pinned)
            if block_hash is not None:
                return block_hash
        return self._drop_oldest(self.t2, self.b2, pinned)

    def _drop_oldest(self, resident: OrderedDict, ghosts: OrderedDict, pinned):
        for block_hash in resident:
            if block_hash not in pinned:
                del resident[block_hash]
                ghosts[block_hash] = None
                if len(ghosts) > self.capacity:  # only this ghost list grew, by one
                    ghosts.popitem(last=False)
                return block_hash
        return None

    def clear(self) -> None:
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()
        self.target_t1 = 0

    def resident(self) -> list:
        return [*self.t1, *self.t2]

    def check(self) -> None:
        if set(self.t1) & set(self.t2) or len(self.b1) > self.capacity or len(self.b2) > self.capacity \
                or not 0 <= self.target_t1 <= self.capacity:
            raise InvariantViolation("the offload tier's ARC lists overlap, or a ghost list or the target is out "
                                     "of bounds")


OFFLOAD_POLICIES = {"lru": LRUOrder, "arc": ARCOrder}
OFFLOAD_ADMISSIONS = ("always", "reused")


class ReuseFilter:
    """How often each recent hash was looked up, in an LRU table of at most ``max_entries``."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.counts: OrderedDict = OrderedDict()

    def record(self, hashes) -> None:
        counts = self.counts
        for block_hash in hashes:
            if block_hash in counts:
                counts.move_to_end(block_hash)
                counts[block_hash] += 1
            else:
                if len(counts) >= self.max_entries:
                    counts.popitem(last=False)
                counts[block_hash] = 1

    def admits(self, block_hash) -> bool:
        return self.counts.get(block_hash, 0) >= REUSE_THRESHOLD


def check_offload_options(policy: str, admission: str) -> None:
    if not isinstance(policy, str) or policy not in OFFLOAD_POLICIES:  # a list would be unhashable in the dict
        raise InvalidArgumentError(f"offload_policy must be one of {sorted(OFFLOAD_POLICIES)}, got {policy!r}")
    if not isinstance(admission, str) or admission not in OFFLOAD_ADMISSIONS:
        raise InvalidArgumentError(f"offload_admission must be 'always' or 'reused', got {admission!r}")
