"""A solution of kvlab.puzzles.lru_policy."""

from collections import OrderedDict
from itertools import chain

from kvlab.blocks import EvictionPolicy
from kvlab.errors import OutOfBlocksError


class MyLRU(EvictionPolicy):
    def __init__(self):
        # Two queues, oldest first; an OrderedDict removes from the middle in O(1).
        self.uncached: OrderedDict[int, None] = OrderedDict()
        self.cached: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int, cached: bool) -> None:
        (self.cached if cached else self.uncached)[block_id] = None

    def remove(self, block_id: int) -> None:
        if self.cached.pop(block_id, 0) is not None:  # not there: it is an uncached one
            del self.uncached[block_id]

    def pop(self) -> int:
        for queue in (self.uncached, self.cached):
            if queue:
                return queue.popitem(last=False)[0]
        raise OutOfBlocksError("no free block")

    def __iter__(self):
        return chain(self.uncached, self.cached)

    def __len__(self) -> int:
        return len(self.uncached) + len(self.cached)
