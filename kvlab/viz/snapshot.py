"""A frozen copy of what kvlab.viz draws: each GPU block's state and ref count, and the block tables.

Drawings work on a ``PoolView`` rather than on the live manager so that a sequence of steps can be recorded
(``snapshot`` after each operation) and drawn later side by side or in a step-through widget. Every public
drawing function also accepts a live ``BlockManager`` and takes the snapshot itself.

Only the manager's public API is read.
"""

from dataclasses import dataclass, field

import numpy as np

from kvlab.blocks.manager import NULL_BLOCK, BlockManager
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError

# Block states, in legend order. SHARED is a used block with ref count > 1 (several table entries point at
# it): the blocks that prefix hits and forks save, highlighted because they are what the notebooks teach.
FREE, WARM, USED, SHARED, NULL = range(5)
STATE_NAMES = ("free", "warm (free, cached)", "used", "shared (ref > 1)", "null (sliding window)")
STATE_COLORS = ("#e4e4e4", "#f2b447", "#4e79a7", "#d1495b", "#2b2b2b")
CPU_COLOR = "#59a89c"  # blocks of swapped-out sequences, in the CPU pool


@dataclass(frozen=True)
class TableView:
    """One sequence's block table at snapshot time. ``blocks`` are CPU block ids when ``on_cpu``."""
    seq_id: int
    status: str
    num_tokens: int
    blocks: tuple
    on_cpu: bool
    num_released: int = 0  # leading entries the sliding window released (they point at the null block)
    name: str = ""         # the notebook's name for the sequence ("A", "chat"); drawings fall back to its id

    @property
    def display_name(self) -> str:
        return self.name or f"seq {self.seq_id}"

    def tokens_in(self, i: int, block_size: int) -> int:
        """How many token slots of logical block ``i`` are filled (block_size except maybe the last)."""
        return max(0, min(block_size, self.num_tokens - i * block_size))


@dataclass(frozen=True)
class PoolView:
    """The GPU pool at one moment. Arrays are indexed by block id, shape ``[num_blocks]``."""
    num_blocks: int
    block_size: int
    states: np.ndarray        # int8, one of FREE/WARM/USED/SHARED/NULL
    refs: np.ndarray          # int32 ref counts
    cached: np.ndarray        # bool: a prefix lookup can hit the block now (in use or warm)
    reuse_rank: np.ndarray    # int32: position in the free list (0 = reused next); -1 if not free
    tables: tuple = ()        # TableView per sequence passed to ``snapshot``, in that order
    num_free_cpu_blocks: int = 0
    label: str = ""
    cpu_refs: dict = field(default_factory=dict)  # CPU block id -> its ref count, for blocks in use

    def count(self, state: int) -> int:
        return int(np.count_nonzero(self.states == state))

    def summary(self) -> str:
        """E.g. ``"3 used, 1 shared, 2 warm, 10 free"`` (states that occur, legend order)."""
        parts = [f"{self.count(s)} {STATE_NAMES[s].split(' ')[0]}" for s in (USED, SHARED, WARM, FREE, NULL)
                 if self.count(s)]
        return ", ".join(parts)


def _check_seqs(seqs) -> list:
    if isinstance(seqs, Sequence):
        return [seqs]
    seqs = list(seqs)
    for seq in seqs:
        if not isinstance(seq, Sequence):
            raise InvalidArgumentError(f"expected kvlab.Sequence objects, got {type(seq).__name__}")
    return seqs


def names_for(seqs: list, names) -> list[str]:
    """One display name per sequence: ``names`` is None, a list parallel to ``seqs``, or a mapping from
    sequence id to name (sequences it does not name get "")."""
    if names is None:
        return [""] * len(seqs)
    if hasattr(names, "get"):
        return [str(names.get(seq.seq_id, "")) for seq in seqs]
    names = [str(n) for n in names]
    if len(names) != len(seqs):
        raise InvalidArgumentError(f"{len(names)} names for {len(seqs)} sequences")
    return names


def snapshot(manager: BlockManager, seqs=(), label: str = "", *, names=None) -> PoolView:
    """Copy the pool state of ``manager`` and the block tables of ``seqs`` (any iterable of Sequence; a
    finished or waiting sequence shows as an empty table). ``names``: what the drawings call each sequence,
    as a list parallel to ``seqs`` or a dict from sequence id to name (default ``seq <id>``). O(num_blocks)."""
    if not isinstance(manager, BlockManager):
        raise InvalidArgumentError(f"expected a kvlab.BlockManager, got {type(manager).__name__}")
    seqs = _check_seqs(seqs)
    seq_names = names_for(seqs, names)
    n = manager.num_blocks
    refs = np.fromiter((manager.ref_count(b) for b in range(n)), dtype=np.int32, count=n)
    cached = np.fromiter((manager.is_cached(b) for b in range(n)), dtype=bool, count=n)
    states = np.full(n, FREE, dtype=np.int8)
    states[refs > 0] = USED
    states[refs > 1] = SHARED
    states[(refs == 0) & cached] = WARM
    if manager.sliding_window is not None:
        states[NULL_BLOCK] = NULL  # reserved: released table entries point at it; never free, never used
    reuse_rank = np.full(n, -1, dtype=np.int32)
    free = manager.free_block_ids()
    reuse_rank[free] = np.arange(len(free), dtype=np.int32)
    tables = []
    for seq, name in zip(seqs, seq_names):
        blocks = tuple(seq.block_table)
        allocated = bool(blocks)  # allocate always gives at least one block; free empties the table
        on_cpu = allocated and manager.is_swapped(seq)
        released = manager.num_released_blocks(seq) if allocated else 0
        tables.append(TableView(seq.seq_id, seq.status.name.lower(), seq.num_tokens, blocks, on_cpu, released, name))
    cpu_refs = {b: manager.cpu_ref_count(b) for b in range(manager.num_cpu_blocks) if manager.cpu_ref_count(b)}
    return PoolView(n, manager.block_size, states, refs, cached, reuse_rank, tuple(tables),
                    manager.num_free_cpu_blocks, label, cpu_refs)


def as_view(pool, seqs=(), names=None) -> PoolView:
    """``pool`` itself if it is a PoolView (``seqs`` and ``names`` must then be empty), else
    ``snapshot(pool, seqs, names=names)``."""
    if isinstance(pool, PoolView):
        if _check_seqs(seqs) or names is not None:
            raise InvalidArgumentError("pass sequences and names to snapshot(), not alongside an existing PoolView")
        return pool
    return snapshot(pool, seqs, names=names)
