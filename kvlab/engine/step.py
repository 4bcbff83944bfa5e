"""The step contract: what the scheduler decided, frozen, and the only thing the runner and the step loop read.

vLLM V1's ``SchedulerOutput``: once ``schedule()`` returns, the step says for every sequence which positions
its forward pass computes, whether it samples, and (per KV cache group) what changed in its block table and
the slots of those positions, read from the block manager once, when the sequence was scheduled. The runner
keeps every running sequence's tables and brings them up to date from the step (as vLLM's worker keeps its
``InputBatch.block_table`` from ``new_block_ids``), builds its tensors from that, the step loop samples from
it, and failure isolation re-runs from it, so a call into the manager after scheduling can no longer change
what runs.

Table edits: ``SentTables`` remembers, per sequence, the tables the scheduler last sent; a step carries for
each group only ``TableEdit(start, blocks)``, "table[start:] = blocks" (a decode that stays in its last block
sends nothing; a new block, a copy-on-write, a sliding window's release or a swap-in send the tail from the
first block that changed), and ``forgotten``: the sequences freed since the last step with entries, whose
tables the runner drops before applying the edits (a sequence freed and scheduled again starts from a whole
table).

Invariant: entries are in scheduling order, one per sequence; ``start < end``; ``end`` is the sequence's
``num_computed_tokens`` once scheduled (the progress counter lives on the sequence: kvlab.blocks.sequence);
``slots[g]`` has ``end - start`` entries (-1 where a sliding window released the block); the last
``num_draft_tokens`` of the positions are draft tokens to verify (``draft_token_ids``, proposed by
speculative decoding: kvlab.engine.speculative), which are not in the sequence's tokens yet; a step's block
moves are applied before its forward pass.
"""

from collections import namedtuple
from dataclasses import dataclass, field

from kvlab.blocks.sequence import Sequence

Round = namedtuple("Round", "kind pairs srcs dsts")
TableEdit = namedtuple("TableEdit", "start blocks")  # one group's table: table[start:] = blocks


class SentTables:
    """The block tables the runner holds, as the scheduler last sent them: what lets a step carry only what
    changed. Owned by the scheduler; ``forget`` when it frees a sequence."""

    def __init__(self):
        self._tables: dict[int, tuple[tuple[int, ...], ...]] = {}  # seq_id -> [groups][blocks]
        self._forgotten: list[int] = []

    def edits(self, seq_id: int, tables: tuple[tuple[int, ...], ...]) -> tuple[TableEdit, ...]:
        """One edit per group turning what the runner holds for ``seq_id`` into ``tables``, now recorded as
        sent."""
        old = self._tables.get(seq_id) or ((),) * len(tables)
        self._tables[seq_id] = tables
        starts = map(_first_change, old, tables)
        return tuple(TableEdit(start, table[start:]) for start, table in zip(starts, tables))

    def forget(self, seq_id: int) -> None:
        if self._tables.pop(seq_id, None) is not None:
            self._forgotten.append(seq_id)

    def take_forgotten(self) -> tuple[int, ...]:
        forgotten, self._forgotten = tuple(self._forgotten), []
        return forgotten


def _first_change(old: tuple, new: tuple) -> int:
    """The first index where ``new`` differs from ``old`` (``len(old)`` when it only grew)."""
    if new[:len(old)] == old:  # the usual case, compared in C
        return len(old)
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), len(new))


class BlockMoves:
    """One step's block moves, kept in the order the scheduler made them (a block swapped out may be reused
    by a later copy in the same step, so order matters). Consecutive moves of one kind are grouped into a
    single launch unless a block would be written twice, or (copy-on-write, inside one cache) be both read and
    written in that launch."""

    KINDS = ("swap_out", "copy", "swap_in", "offload", "promote")

    def __init__(self):
        self.rounds: list[Round] = []
        self.counts = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, pairs) -> None:
        for src, dst in pairs:
            last = self.rounds[-1] if self.rounds else None
            if (last is None or last.kind != kind or dst in last.dsts
                    or (kind == "copy" and (src in last.dsts or dst in last.srcs))):
                last = Round(kind, [], set(), set())
                self.rounds.append(last)
            last.pairs.append((src, dst))
            last.srcs.add(src)
            last.dsts.add(dst)
            self.counts[kind] += 1


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One sequence's part of a step: it computes the K/V of positions ``start .. end - 1``."""
    seq: Sequence
    start: int                       # after the cached prefix, the chunks earlier steps computed, or a decode's
                                     # last token (the one with no K/V yet)
    end: int                         # one past the last position with a slot
    prefill: bool                    # prompt (or recomputed) tokens; else one decode token
    table_edits: tuple[TableEdit, ...]   # [groups]: what changed in each KV cache group's block table
    slots: tuple[tuple[int, ...], ...]   # [groups][end - start]: where each new token's K/V goes
    num_draft_tokens: int = 0        # of those positions, the last ones hold proposed tokens to verify
    draft_token_ids: tuple[int, ...] = ()  # those tokens (num_draft_tokens of them when the scheduler drafts)

    def input_ids(self) -> list[int]:
        """The token of every position the step computes: the sequence's, then the drafts."""
        return self.seq.token_slice(self.start, self.end - self.num_draft_tokens) + list(self.draft_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """The step computes the sequence's last token (drafts aside), so its next token is sampled (a prompt
        chunk short of the end produces none)."""
        return self.end - self.num_draft_tokens == self.seq.num_tokens

    def written_blocks(self, block_size: int) -> set[int]:
        """Blocks this step writes K/V into, in any group."""
        return {slot // block_size for group in self.slots for slot in group if slot >= 0}


class _EntriesView:
    """What a step and its draft both answer from their ``entries`` and ``preempted``."""

    @property
    def seqs(self) -> list[Sequence]:
        return [entry.seq for entry in self.entries]

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)


@dataclass(frozen=True)
class ScheduledStep(_EntriesView):
    kind: str                          # "prefill", "decode" or (V1 scheduling) "mixed"
    entries: tuple[SeqStep, ...]
    moves: BlockMoves                  # apply before the forward pass
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache (not computed)
    preempted: tuple[Sequence, ...] = ()  # preempted (recompute or swap) to make room, in that order
    aborted: tuple = ()                # (sequence, why): can never run in this pool
    forgotten: tuple[int, ...] = ()    # seq_ids freed since the last step with entries: the runner drops them

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (or recomputed) tokens computed, after prefix hits."""
        return sum(entry.num_tokens for entry in self.entries if entry.prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.entries if not entry.prefill)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the forward pass computes."""
        return sum(entry.num_tokens for entry in self.entries)


@dataclass
class StepBuilder(_EntriesView):
    """The scheduler's draft of a step; ``freeze`` makes the ``ScheduledStep`` everyone else reads. ``sent``:
    the scheduler's record of the runner's tables (None: every entry sends its whole tables)."""
    kind: str
    sent: SentTables | None = None
    moves: BlockMoves = field(default_factory=BlockMoves)
    entries: list[SeqStep] = field(default_factory=list)
    num_cached_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    aborted: list = field(default_factory=list)

    def record(self, kind: str, copies) -> None:
        """The block moves a manager call returned (``kind``: "copy", "swap_in", "swap_out": a ``BlockCopies``),
        after the offload tier's copies the same call made (``copies.tier_moves``), which come first."""
        self.record_tier_moves(copies.tier_moves)
        self.moves.add(kind, copies)

    def record_admission(self, admitted) -> None:
        """The block moves ``allocate`` returned (an ``Admitted``): the offload tier's copies, then a partial-block
        hit's copy (``prefix_match_unit``), each before the forward pass that reads them."""
        self.record_tier_moves(admitted.tier_moves)
        if admitted.partial:
            self.moves.add("copy", admitted.copies)

    def record_tier_moves(self, tier_moves) -> None:
        """The offload tier's copies a manager call returned, batches in order (``Admitted.tier_moves`` of
        ``allocate``: ``TierMove``s)."""
        for kind, sources, targets in tier_moves:
            self.moves.add(kind, zip(sources, targets))

    def add(self, manager, seq: Sequence, start: int, *, prefill: bool, drafts: tuple[int, ...] = ()) -> SeqStep:
        """Put ``seq`` in the step from position ``start`` to its progress counter, its slots already given by
        the manager, whose records are read here, once; ``drafts``: the tokens of its last positions, proposed
        (``append_slots(seq, num_draft_tokens=len(drafts))`` gave them slots)."""
        end = seq.num_computed_tokens
        tables = tuple(map(tuple, manager.block_tables(seq)))
        edits = (tuple(TableEdit(0, table) for table in tables) if self.sent is None
                 else self.sent.edits(seq.seq_id, tables))
        entry = SeqStep(seq, start, end, prefill, edits, tuple(map(tuple, manager.slot_mappings(seq, start, end))),
                        len(drafts), tuple(drafts))
        self.entries.append(entry)
        return entry

    def freeze(self, kind: str | None = None) -> ScheduledStep:
        # A step without entries never reaches the runner: its forgotten ids wait for the next one.
        forgotten = self.sent.take_forgotten() if self.sent is not None and self.entries else ()
        return ScheduledStep(kind or self.kind, tuple(self.entries), self.moves, self.num_cached_tokens,
                             tuple(self.preempted), tuple(self.aborted), forgotten)
