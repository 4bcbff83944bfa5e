"""A frozen copy of what kvlab.viz draws: each GPU block's state and ref count, and the block tables.

Drawings work on a ``PoolView`` rather than on the live manager so that a sequence of steps can be recorded
(``snapshot`` after each operation) and drawn later side by side or in a step-through widget. Every public
drawing function also accepts a live ``BlockManager`` or ``HybridBlockManager`` and takes the snapshot itself.

A hybrid manager's groups share one pool, so its pool reads as a ``BlockManager``'s; its tables are one
``TableView`` per (sequence, group), sequence after sequence, each labelled with its group ("full", "window 8").
Only the managers' public queries (kvlab.blocks.manager, the same for both) are read.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.manager import NULL_BLOCK, KVCacheManager
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError

# Block states, in legend order. SHARED is a used block with ref count > 1 (several table entries point at
# it): the blocks that prefix hits and forks save, highlighted because they are what the notebooks teach.
FREE, WARM, USED, SHARED, NULL = range(5)
STATE_NAMES = ("free", "warm (free, cached)", "used", "shared (ref > 1)", "null (sliding window)")
STATE_COLORS = ("#e4e4e4", "#f2b447", "#4e79a7", "#d1495b", "#2b2b2b")
CPU_COLOR = "#59a89c"  # blocks of swapped-out sequences, in the CPU pool
MANAGERS = (KVCacheManager,)  # BlockManager and HybridBlockManager are ones too


@dataclass(frozen=True)
class TableView:
    """One sequence's block table at snapshot time (a hybrid manager's: one group's). ``blocks`` are CPU block
    ids when ``on_cpu``."""
    seq_id: int
    status: str
    num_tokens: int
    blocks: tuple
    on_cpu: bool
    num_released: int = 0  # leading entries the sliding window released (they point at the null block)
    name: str = ""         # the notebook's name for the sequence ("A", "chat"); drawings fall back to its id
    group: Optional[int] = None  # the KV cache group of a hybrid manager's table; None for a BlockManager's
    group_label: str = ""        # what the drawings call that group ("full", "window 8")
    block_size: Optional[int] = None  # its group's tokens per block (None: the pool's)

    @property
    def display_name(self) -> str:
        name = self.name or f"seq {self.seq_id}"
        return f"{name} · {self.group_label}" if self.group_label else name

    @property
    def key(self) -> str:
        """What the drawings' gids call this table: ``"<seq id>"``, or ``"<seq id>g<group>"`` for a group's."""
        return str(self.seq_id) if self.group is None else f"{self.seq_id}g{self.group}"

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


def group_labels(specs) -> list[str]:
    """What the drawings call each KV cache group (specs from ``manager.groups``): "full" or "window <W>",
    with "(group g)" added where two groups would read alike."""
    labels = ["full" if spec.sliding_window is None else f"window {spec.sliding_window}" for spec in specs]
    return [f"{label} (group {g})" if labels.count(label) > 1 else label for g, label in enumerate(labels)]


def snapshot(manager, seqs=(), label: str = "", *, names=None) -> PoolView:
    """Copy the pool state of ``manager`` (a BlockManager or a HybridBlockManager) and the block tables of
    ``seqs`` (any iterable of Sequence; a finished or waiting sequence shows as an empty table; a hybrid
    manager's sequence as one table per group). ``names``: what the drawings call each sequence, as a list
    parallel to ``seqs`` or a dict from sequence id to name (default ``seq <id>``). O(num_blocks)."""
    if not isinstance(manager, MANAGERS):
        raise InvalidArgumentError("expected a kvlab.BlockManager (or a HybridBlockManager, or the engine's "
                                   "KVCacheManager), "
                                   f"got {type(manager).__name__}")
    seqs = _check_seqs(seqs)
    seq_names = names_for(seqs, names)
    n = manager.num_blocks
    refs = np.fromiter((manager.ref_count(b) for b in range(n)), dtype=np.int32, count=n)
    cached = np.fromiter((manager.is_cached(b) for b in range(n)), dtype=bool, count=n)
    states = np.full(n, FREE, dtype=np.int8)
    states[refs > 0] = USED
    states[refs > 1] = SHARED
    states[(refs == 0) & cached] = WARM
    if any(spec.sliding_window is not None for spec in manager.groups):
        states[NULL_BLOCK] = NULL  # reserved: released table entries point at it; never free, never used
    reuse_rank = np.full(n, -1, dtype=np.int32)
    free = manager.free_block_ids()
    reuse_rank[free] = np.arange(len(free), dtype=np.int32)
    # A BlockManager's one table per sequence is unlabelled (group None); a hybrid manager's are per group.
    several = isinstance(manager, HybridBlockManager) or len(manager.groups) > 1
    labels = group_labels(manager.groups)
    if len(set(manager.group_block_sizes)) > 1:
        labels = [f"{label}, {size}-token blocks" for label, size in zip(labels, manager.group_block_sizes)]
    groups = list(enumerate(labels)) if several else [(None, "")]
    tables = tuple(table for seq, name in zip(seqs, seq_names) for table in _tables(manager, seq, name, groups))
    cpu_refs = {b: manager.cpu_ref_count(b) for b in range(manager.num_cpu_blocks) if manager.cpu_ref_count(b)}
    return PoolView(n, manager.block_size, states, refs, cached, reuse_rank, tables,
                    manager.num_free_cpu_blocks, label, cpu_refs)


def _tables(manager, seq: Sequence, name: str, groups: list) -> list[TableView]:
    """``seq``'s table in each of ``groups`` ((group, label) pairs, in group order). Released entries are
    counted by the manager, never read off the table: a swapped-out table's null entries and CPU block 0
    both read 0."""
    allocated = bool(seq.block_table)  # allocate gives every group at least one block; free empties the tables
    on_cpu = allocated and manager.is_swapped(seq)
    blocks = manager.block_tables(seq) if allocated else [()] * len(groups)
    released = manager.num_released_blocks_per_group(seq) if allocated else [0] * len(groups)
    status = seq.status.name.lower()
    sizes = manager.group_block_sizes  # groups may differ (group_block_sizes)
    return [TableView(seq.seq_id, status, seq.num_tokens, tuple(table), on_cpu, num_released, name, group, label,
                      sizes[group or 0])
            for table, num_released, (group, label) in zip(blocks, released, groups)]


def as_view(pool, seqs=(), names=None) -> PoolView:
    """``pool`` itself if it is a PoolView (``seqs`` and ``names`` must then be empty), else
    ``snapshot(pool, seqs, names=names)``."""
    if isinstance(pool, PoolView):
        if _check_seqs(seqs) or names is not None:
            raise InvalidArgumentError("pass sequences and names to snapshot(), not alongside an existing PoolView")
        return pool
    return snapshot(pool, seqs, names=names)
