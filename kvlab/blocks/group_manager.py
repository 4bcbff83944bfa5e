"""One KV cache group's manager (vLLM V1's ``SingleTypeKVCacheManager``): its records and its half of every call.

A ``GroupManager`` serves one KV cache group of one attention spec (kvlab.blocks.kv_cache_groups: full attention
or a sliding window) on the parts every group of a manager shares (the GPU pool, the CPU pool, the offload tier,
the event sink: kvlab.blocks.manager's ``SharedParts``). It owns one ``Allocation`` per sequence, in a dict keyed
by the sequence's id, and nothing else: a sequence's tokens, hashes and progress counters are the sequence's
own (kvlab.blocks.sequence), the same for every group.

The coordinator (``BlockManager``, kvlab.blocks.manager) makes every call in two halves per group, so a failed
call changes nothing in any group: first each group's plan (pure: ``plan_admission``, ``plan_step`` and
``hashes_to_seal``, ``plan_accept``, ``plan_release``, ``moving_out``, ``swap_in_needs``), then the room check
and every group's eviction-policy calls in one transaction, then each group's bookkeeping (``admit``,
``apply_step``, ``accept``, ``release``, ``moved_out``, ``moved_in``, ``fork``), which cannot fail. A group
looks up and seals in its own namespace of the prefix index, so one group's plan never depends on another's
bookkeeping.

Chunked prompts (vLLM V1's ``allocate_slots(request, num_new_tokens)``): a step schedules the next
``num_new_tokens`` tokens that have no slot yet. Only blocks whose last token a step schedules are sealed
(hittable): under the engine's write-before-read rule (kvlab.blocks.manager) a request hitting such a block in
the same step reads K/V written before its own attention.

Speculative decoding (vLLM V1 schedules drafts as new tokens and rolls ``num_computed_tokens`` back by the
rejected ones): ``append_slots(seq, num_draft_tokens=k)`` gives k draft positions after the last token their
slots; only blocks below the verified positions are sealed, so a block holding a draft is never hashed,
published or hit. ``accept_drafts`` seals the blocks the accepted drafts complete at once (their K/V is in
place), and the rejected positions keep their slots for the next step to overwrite. A fork with drafts in
flight shares them; when one sibling accepts more than the other it seals a block the other writes again, so a
step never writes a sealed block: shared, it is copied; held alone, it leaves the prefix cache first
(``BlockPool.unseal``). ``Allocation.forked_drafts`` records which blocks a sibling may have sealed.

Encoder-decoder requests (vLLM V0's cross block table): one ``CrossTable`` per request group (the sequence
allocated with ``encoder_seq`` and its forks), never prefix-cached, moved to the CPU with the group's last
sequence on the GPU and back with the first one swapped in; only a one-group manager has them.
"""

from collections import Counter
from dataclasses import dataclass
from itertools import groupby
from typing import NamedTuple, Optional

from kvlab.blocks.prefix_cache import NO_CONTENT, ROOT, UnitPrefixIndex, block_hashes, hashes_to_seal, sealed_through
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError, InvariantViolation, SequenceStateError
from kvlab.validation import check_int

NULL_BLOCK = 0  # with a sliding window, block 0 is reserved: every released table entry points at it


@dataclass(slots=True, eq=False)  # eq=False: records are compared and hashed by identity (CrossTable.members)
class Allocation:
    """A group's record of one sequence: its block table and how far the prefix cache has it. How far the
    sequence got is the sequence's own ``num_computed_tokens``, the same in every group."""
    seq: Sequence
    table: list
    # Leading full blocks already sealed, and the chain's tail (hash, content id) that the next seal extends.
    # With prefix caching, num_sealed == verified positions // block_size.
    num_sealed: int
    last_hash: Optional[int]
    last_content: int
    num_released: int   # leading table entries released by the sliding window
    # Positions < num_slots have a slot: the scheduled ones plus lookahead slots. The table holds exactly
    # ceil(num_slots / block_size) entries (it never shrinks).
    num_slots: int
    cross: Optional["CrossTable"] = None  # the request group's CrossTable (encoder-decoder), or None
    on_cpu: bool = False                  # swapped out: the table holds CPU blocks
    forked_drafts: frozenset = frozenset()  # blocks shared with a fork while drafts were in flight

    def live_blocks(self) -> list[int]:
        """Table entries that hold a reference (the sliding window's released ones do not)."""
        return self.table[self.num_released:]

    def copy_for(self, seq) -> "Allocation":
        twin = Allocation(seq, list(self.table), self.num_sealed, self.last_hash, self.last_content,
                          self.num_released, self.num_slots, self.cross)
        twin.forked_drafts = self.forked_drafts
        return twin


class CrossTable:
    """The encoder's K/V blocks of one request group: written once by the encoder pass, read by every decoder
    sequence of the group; the group holds one reference to each block, however many forks it has."""
    __slots__ = ("root", "blocks", "num_tokens", "on_cpu", "members")

    def __init__(self, root, blocks, num_tokens):
        self.root, self.blocks, self.num_tokens, self.on_cpu = root, blocks, num_tokens, False
        self.members: set = set()  # allocations of the group's live sequences

    def members_on_gpu(self) -> int:
        return sum(1 for alloc in self.members if not alloc.on_cpu)


# ---- plans: what a call needs, worked out before anything changes (pure) ----------------------------------------
def new_tokens(seq, num_new_tokens, num_scheduled: int) -> int:
    """How many tokens a step schedules: ``num_new_tokens`` of those after position ``num_scheduled`` (they
    have no slot yet), or all of them for None."""
    remaining = seq.num_tokens - num_scheduled
    if num_new_tokens is None:
        return remaining
    if remaining == 0:
        raise InvalidArgumentError(f"num_new_tokens={num_new_tokens!r}, but every token of sequence {seq.seq_id} "
                                   "has a slot already (append_token first, or pass None)")
    try:
        return check_int("num_new_tokens", num_new_tokens, 1, remaining)
    except InvalidArgumentError as e:  # say where the bound comes from
        raise InvalidArgumentError(f"{e} (sequence {seq.seq_id} has {remaining} tokens without a slot after its "
                                   f"{num_scheduled} cached or scheduled ones; None schedules them all)") from None


def least_peak_blocks(scheduled: int, num_tokens: int, block_size: int, spec, lookahead: int) -> int:
    """The fewest blocks a sequence must hold at once to give positions ``scheduled .. num_tokens - 1`` their
    slots later, however they are chunked (0 if there are none): the spec's rule."""
    if scheduled >= num_tokens:
        return 0
    return spec.least_peak_blocks(scheduled, num_tokens, block_size, lookahead)


class AllocationPlan(NamedTuple):
    hits: list         # cached blocks matching the prompt's first full blocks (cut to the hit every group serves)
    tier_hits: tuple   # offload-tier slots continuing the hits: promoted into the first new blocks
    first_live: int    # leading hits outside the sliding window (not pinned)
    scheduled: int     # positions with slots after allocate: the hits plus the first chunk
    live_blocks: int   # blocks the sequence holds after allocate (plus lookahead)
    needed_free: int   # of which come out of the free pool
    peak_blocks: int   # blocks it must hold at once at some step until its prompt is done (at the least)
    num_new: int       # blocks allocate takes for the positions after the hits (lookahead aside)
    num_sealed: int    # leading full blocks sealed once allocated: the hits plus those this step writes to the end


class StepPlan(NamedTuple):
    scheduled: int     # seq.num_computed_tokens after the step (drafts included)
    release_upto: int  # num_released after the step
    release: list      # blocks leaving the window, tail first (as free() releases)
    freed: list        # those of them that become free...
    freed_cached: list  # ...and whether each is cached
    touched: range     # indices of existing blocks the step writes
    copies: set        # those of them that are shared: copy-on-write
    num_new: int       # blocks to append
    unseal: list       # touched blocks held by this sequence alone that a fork sibling sealed

    @property
    def blocks_needed(self) -> int:
        return len(self.copies) + self.num_new


class GroupManager:
    """KV cache group ``group`` of attention ``spec``, on ``parts`` (a manager's ``SharedParts``), reporting to
    ``sink`` (the shared sink, tagged with the group where there are several)."""

    def __init__(self, spec, group: int, parts, sink):
        self.spec, self.group = spec, group
        self.prefix_caching, self.hash_fn = parts.enable_prefix_caching, parts.hash_fn
        # The group's blocks hold ``span`` of the sequence's blocks (at which prompts are hashed): 1 unless the
        # manager's groups have different block sizes.
        self.block_size = parts.group_block_sizes[group]
        self.span = self.block_size // parts.block_size
        self.pool, self.swap, self.tier, self.sink = parts.pool, parts.swap, parts.tier, sink
        # None: kvlab's copy-on-write and release rules (plan_step); a learner's release only for a window
        self.plan_append = parts.plan_append
        self.plan_window_release = parts.plan_window_release if spec.sliding_window is not None else None
        self.records: dict[int, Allocation] = {}  # seq_id -> the sequence's record in this group
        # prefix_match_unit < block_size: seq_id -> the positions below which its prompt's units are findable
        self.units_indexed: dict[int, int] = {}

    # ---- a sequence's record --------------------------------------------------------------------------------
    def record(self, seq) -> Allocation:
        alloc = self.records.get(seq.seq_id)
        if alloc is None or alloc.seq is not seq:
            raise SequenceStateError(f"sequence {seq.seq_id} is not allocated in this manager (never allocated, "
                                     "already freed, allocated in another manager, or an unpickled copy)")
        return alloc

    def gpu_record(self, seq) -> Allocation:
        alloc = self.record(seq)
        if alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is swapped out; swap_in first")
        return alloc

    # ---- the group's own questions ----------------------------------------------------------------------
    def own_blocks(self, hashes: list, contents: list) -> tuple[list, list]:
        """The group's full blocks' (hashes, bytes) from the sequence's (``span`` of them to a block): a block's
        hash is the chain hash of its last sequence block, which names the whole prefix, its bytes theirs
        joined (so a lookup still verifies every token and key)."""
        span = self.span
        if span == 1:
            return hashes, contents
        n = len(hashes) // span
        return hashes[span - 1:n * span:span], [b"".join(contents[i * span:(i + 1) * span]) for i in range(n)]

    def own_keys(self, keys: Optional[dict], i: int) -> bytes:
        """The keys' bytes (``seq.key_bytes``) of the group's block ``i``: its sequence blocks' joined."""
        if not keys:
            return b""
        span = self.span
        return keys.get(i, b"") if span == 1 else b"".join(keys.get(j, b"") for j in range(i * span, (i + 1) * span))

    def seals(self, seq, start: int, stop: int) -> tuple[list, list]:
        """The (hashes, bytes) of the group's blocks ``start .. stop - 1``, hashed only if new."""
        span = self.span
        if span == 1:
            return hashes_to_seal(seq, start, stop, self.block_size, self.hash_fn)
        return self.own_blocks(*hashes_to_seal(seq, start * span, stop * span, self.block_size // span, self.hash_fn))

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of positions start..end-1; -1 where the sliding window
        released the block. Only positions with a slot can be asked for."""
        alloc, bs = self.gpu_record(seq), self.block_size
        if not (check_int("start", start, 0) <= check_int("end", end, 0) <= alloc.num_slots):
            raise InvalidArgumentError(f"need 0 <= start <= end <= {alloc.num_slots} (positions with slots), got "
                                       f"start={start!r}, end={end!r}")
        table, released = alloc.table, alloc.num_released
        return [-1 if p // bs < released else table[p // bs] * bs + p % bs for p in range(start, end)]

    def find_hits(self, hashes, contents, limit: int) -> tuple[list[int], tuple]:
        """The prefix lookup: (the GPU blocks of this group holding the prompt's first full blocks, then the
        offload tier's slots continuing them), at most ``limit`` blocks in all. Pure."""
        hits = self.pool.index.lookup(hashes, contents, limit, ROOT, self.group)
        if self.tier is None:
            return hits, ()
        return hits, self.tier.lookup(hashes, contents, limit, hits, self.pool.index)

    # ---- allocate ---------------------------------------------------------------------------------------
    def plan_admission(self, seq, hits, hit, lookahead: int, num_new_tokens):
        """allocate's plan from the group's hits (``find_hits``, cut to the hit every group serves; then
        ``hit``'s tier hits and partial-block tokens, copied into the first new blocks): the first step computes
        the ``num_new_tokens`` tokens after them (None: the rest of the prompt)."""
        bs, spec, n, tier_hits = self.block_size, self.spec, seq.num_tokens, hit.tier_hits
        cached = hit.num_tokens  # this group's hits and tier hits, then the units of its partial block
        scheduled = n if num_new_tokens is None else cached + new_tokens(seq, num_new_tokens, cached)
        first_live = spec.first_live_block(cached, bs)  # the step's first query is the first uncached token
        live_blocks = -(-(scheduled + lookahead) // bs) - first_live
        hits_in_use = sum(map(bool, map(self.pool.ref.__getitem__, hits[first_live:])))
        # A chunk that fits is no use if the rest of the prompt never can: admission looks at the whole prompt.
        peak = live_blocks if scheduled >= n else max(live_blocks, spec.least_peak_blocks(scheduled, n, bs, lookahead))
        return AllocationPlan(hits, tier_hits, first_live, scheduled, live_blocks, live_blocks - hits_in_use, peak,
                              -(-scheduled // bs) - len(hits), min(len(hit.hashes) // self.span, scheduled // bs))

    def admit(self, seq, plan, hashes, contents, new_blocks, num_revived: int, cross=None) -> None:
        """allocate's bookkeeping, once the policy handed out ``new_blocks`` and took ``num_revived`` of the
        plan's live hits out of the free set: pin the live hits, promote the tier hits, seal the prompt's blocks
        this step writes, and record the sequence (joining ``cross``, its request group's table, if any)."""
        pool, sink = self.pool, self.sink
        if self.span > 1:
            hashes, contents = self.own_blocks(hashes, contents)
        pool.claim(plan.hits[plan.first_live:], num_revived)
        if sink is not None:
            sink.looked_up(seq.seq_id, plan.hits, new_blocks)
        last_content = self._seal_prompt(plan, hashes, contents, new_blocks)
        if self.prefix_caching:
            sealed_through(seq, plan.num_sealed * self.span)
        if sink is not None:
            sink.allocated(seq.seq_id)
        # Hits outside the sliding window prove the chain but are not pinned: the table points at the null block.
        table = [NULL_BLOCK] * plan.first_live + plan.hits[plan.first_live:] + new_blocks
        alloc = Allocation(seq, table, plan.num_sealed, hashes[plan.num_sealed - 1] if plan.num_sealed else None,
                           last_content, plan.first_live, plan.scheduled, cross)
        if cross is not None:
            cross.members.add(alloc)
        self.records[seq.seq_id] = alloc

    def _seal_prompt(self, plan, hashes, contents, new_blocks: list[int]):
        """Promote the tier hits into the first new blocks, then seal the new blocks this step writes to the end;
        returns the content id of the chain's tail, which the next seal extends."""
        pool, sink, stop, start = self.pool, self.sink, plan.num_sealed, len(plan.hits)
        parent = pool.index.content[plan.hits[-1]] if start else ROOT
        if plan.tier_hits:
            promoted = new_blocks[:len(plan.tier_hits)]
            parent = self.tier.promote(pool, plan.tier_hits, promoted)
            if sink is not None:
                sink.stored(pool.index, promoted, hashes[start:start + len(promoted)],
                            contents[start:start + len(promoted)], hashes[start - 1] if start else None)
            new_blocks, start = new_blocks[len(promoted):], start + len(promoted)
        parent = pool.fill(new_blocks, hashes[start:stop], contents[start:stop], parent, self.group)
        if sink is not None:
            sink.stored(pool.index, new_blocks[:stop - start], hashes[start:stop], contents[start:stop],
                        hashes[start - 1] if start else None)
        return parent

    def index_units(self, seq, leaving: bool = False) -> None:
        """``prefix_match_unit`` < block_size: make the whole units of ``seq``'s prompt that its earlier steps
        wrote findable by their chain (``UnitPrefixIndex.add_partial``), each block's after the content of the
        block before it. Only verified prompt positions: a later step never writes them again. ``leaving``: the
        sequence is being freed (the step of its last call ran, by the engine's ordering rule)."""
        alloc, index, bs = self.records[seq.seq_id], self.pool.index, self.block_size
        done = self.units_indexed.pop(seq.seq_id, 0) if leaving else self.units_indexed.get(seq.seq_id, 0)
        upto = min(seq.num_computed_tokens - seq.num_draft_tokens, seq.prefill_end) // index.unit * index.unit
        if alloc.on_cpu or upto <= done or bs == index.unit:  # (a block of one unit has no partial entries)
            return
        if not leaving:
            self.units_indexed[seq.seq_id] = upto
        tokens, keys, table, content = memoryview(seq.token_array), seq.key_bytes, alloc.table, index.content
        for i in range(done // bs, -(-upto // bs)):
            parent = content[table[i - 1]] if i else ROOT
            if parent >= ROOT:  # else the block before holds no sealed content (swapped back in): no chain
                index.add_partial(table[i], self.group, parent, self.own_keys(keys, i),
                                  tokens[i * bs:min(upto, (i + 1) * bs)].tobytes())

    # ---- append_slots -----------------------------------------------------------------------------------
    def plan_step(self, seq, lookahead: int, num_new_tokens, num_drafts: int):
        """(record, StepPlan, num_drafts): the step computes positions ``seq.num_computed_tokens .. scheduled - 1``
        (``num_drafts`` draft positions after the last token included) and reserves ``lookahead`` more slots. A
        sealed block is never written in place: shared, it is copied; held alone, it leaves the prefix cache."""
        alloc = self.gpu_record(seq)
        bs, pool, table = self.block_size, self.pool, alloc.table
        first_query = seq.num_computed_tokens
        scheduled = first_query + new_tokens(seq, num_new_tokens, first_query)
        if num_drafts and scheduled != seq.num_tokens:
            raise InvalidArgumentError(f"draft tokens follow the last token: a step with {num_drafts} of them must "
                                       f"schedule all {seq.num_tokens - first_query} tokens of sequence "
                                       f"{seq.seq_id} without a slot (num_new_tokens=None)")
        scheduled += num_drafts
        if self.plan_window_release is None:
            release_upto = max(alloc.num_released, self.spec.first_live_block(first_query, bs))
        else:  # a learner's (kvlab.engine.parts checks it releases the next entries of the table, in order)
            release_upto = self.plan_window_release(table, alloc.num_released, first_query, self.spec.sliding_window,
                                                    bs)
        release = table[alloc.num_released:release_upto][::-1]
        end = scheduled + lookahead
        touched = range(first_query // bs, min(len(table), -(-end // bs)))
        ref, content = pool.ref, pool.index.content
        if self.plan_append is None:
            copies, num_new = {i for i in touched if ref[table[i]] > 1}, max(0, -(-end // bs) - len(table))
        else:  # a learner's (kvlab.engine.parts checks it keeps the pool consistent)
            copies, num_new = self.plan_append(table, ref, first_query, end, bs)
        unseal = [table[i] for i in touched if i not in copies and content[table[i]] > ROOT]
        plan = StepPlan(scheduled, release_upto, release, *pool.freed_by(release), touched, copies, num_new, unseal)
        return alloc, plan, num_drafts

    def hashes_to_seal(self, step):
        """The (hashes, contents) of the blocks the planned ``step`` seals (drafts aside: they may be rejected),
        or None: hashed before anything changes, so a failing hash_fn leaves no trace."""
        alloc, plan, num_drafts = step
        stop = (plan.scheduled - num_drafts) // self.block_size
        if self.prefix_caching and stop > alloc.num_sealed:
            return self.seals(alloc.seq, alloc.num_sealed, stop)
        return None

    def apply_step(self, step, lookahead: int, taken, seals) -> list[tuple[int, int]]:
        """append_slots' bookkeeping, once the policy took back the plan's freed blocks and handed out ``taken``:
        release what left the window, copy shared blocks about to be written, append new blocks, seal ``seals``.
        Returns the copy-on-write (src, dst) pairs."""
        alloc, plan, _ = step
        pool, table, sink, seq = self.pool, alloc.table, self.sink, alloc.seq
        pool.drop(plan.release, plan.freed)
        self.swap.forget_gpu(plan.freed)
        table[alloc.num_released:plan.release_upto] = [NULL_BLOCK] * len(plan.release)
        alloc.num_released = plan.release_upto
        pool.fill(taken)
        if plan.unseal:
            pool.unseal(plan.unseal)
        fresh, pairs = iter(taken), []
        for i in plan.touched:
            src = table[i]
            if i in plan.copies:
                table[i] = dst = next(fresh)
                pool.drop([src], ())  # shared, so it stays in use
                pairs.append((src, dst))
                if sink is not None:
                    sink.copied(seq.seq_id, dst, src)
            else:
                self.swap.forget_gpu([src])  # written in place: its CPU twin goes stale
        for block in fresh:
            table.append(block)
            if sink is not None:
                sink.appended(seq.seq_id, block)
        if seals is not None:
            hashes, contents = seals
            stop = alloc.num_sealed + len(hashes)
            sealed = table[alloc.num_sealed:stop]
            alloc.last_content = pool.seal(sealed, hashes, contents, alloc.last_content, self.group)
            if sink is not None:
                sink.stored(pool.index, sealed, hashes, contents, alloc.last_hash)
            alloc.num_sealed, alloc.last_hash = stop, hashes[-1]
            sealed_through(seq, alloc.num_sealed * self.span)
        alloc.num_slots = max(alloc.num_slots, plan.scheduled + lookahead)
        return pairs

    # ---- accept_drafts ----------------------------------------------------------------------------------
    def plan_accept(self, seq, verified: int):
        """(record, (hashes, contents) of the blocks that ``verified`` positions complete, or None)."""
        alloc, bs = self.gpu_record(seq), self.block_size
        if self.prefix_caching and verified // bs > alloc.num_sealed:
            return alloc, self.seals(seq, alloc.num_sealed, verified // bs)
        return alloc, None

    def accept(self, alloc, seals) -> None:
        """accept_drafts' bookkeeping: seal blocks ``num_sealed ..`` (one per hash), passing over those a fork
        sibling that accepted the same drafts sealed already (they hold these bytes; the chain goes through)."""
        if seals is None:
            return
        hashes, contents = seals
        pool, index, sink, first = self.pool, self.pool.index, self.sink, alloc.num_sealed
        blocks = alloc.table[first:first + len(hashes)]
        i = 0
        for sealed_already, run in groupby(blocks, key=lambda block: index.content_id(block) > ROOT):
            j = i + len(list(run))
            if sealed_already:
                alloc.last_content = index.content_id(blocks[j - 1])
            else:
                alloc.last_content = pool.seal(blocks[i:j], hashes[i:j], contents[i:j], alloc.last_content,
                                               self.group)
                if sink is not None:
                    sink.stored(index, blocks[i:j], hashes[i:j], contents[i:j],
                                hashes[i - 1] if i else alloc.last_hash)
            i = j
        alloc.num_sealed, alloc.last_hash = first + len(hashes), hashes[-1]
        sealed_through(alloc.seq, alloc.num_sealed * self.span)

    # ---- free and fork ----------------------------------------------------------------------------------
    def plan_release(self, seq):
        """(record, its live blocks tail first, the GPU ones that become free, whether each of those is cached)."""
        alloc = self.record(seq)
        live = alloc.live_blocks()[::-1]
        return (alloc, live, *(((), ()) if alloc.on_cpu else self.pool.freed_by(live)))

    def release(self, alloc, live, freed) -> None:
        """free's bookkeeping, once the policy took back ``freed``: drop the references and forget the record."""
        if alloc.on_cpu:
            self.swap.release(live)
        else:
            self.pool.drop(live, freed)
            self.swap.forget_gpu(freed)
        if alloc.cross is not None:
            alloc.cross.members.discard(alloc)
        del self.records[alloc.seq.seq_id]
        if self.sink is not None:
            self.sink.freed(alloc.seq.seq_id)

    def fork(self, parent, child) -> None:
        """fork's bookkeeping (no policy call): ``child`` shares the parent's blocks, drafts in flight too (from
        the block of the first unverified position on, either may seal a block the other still writes)."""
        alloc = self.gpu_record(parent)
        twin = alloc.copy_for(child)
        if parent.num_draft_tokens:
            first = (parent.num_computed_tokens - parent.num_draft_tokens) // self.block_size
            alloc.forked_drafts = twin.forked_drafts = \
                alloc.forked_drafts | set(alloc.table[max(first, alloc.num_released):])
        self.pool.claim(twin.live_blocks(), 0)  # all in use by the parent: none was free
        if alloc.cross is not None:
            alloc.cross.members.add(twin)
        self.records[child.seq_id] = twin
        if self.sink is not None:
            self.sink.forked(child.seq_id, parent.seq_id)

    # ---- swapping ---------------------------------------------------------------------------------------
    def moving_out(self, seq):
        """(record, (GPU blocks a swap-out moves, the cross table moving with them or None))."""
        alloc = self.gpu_record(seq)
        return alloc, self.swap.moving_out(alloc)

    def moved_out(self, alloc, moving, freed) -> list[tuple[int, int]]:
        """swap_out's bookkeeping, once the policy took back ``freed``; returns the group's (gpu, cpu) copies."""
        self.pool.drop(moving[0], freed)
        mapping = self.swap.moved_out(alloc, moving, freed)
        if self.sink is not None:
            self.sink.swapped_out(alloc.seq.seq_id, mapping)
        return mapping

    def swap_in_needs(self, seq) -> tuple[int, int]:
        """(GPU blocks the swapped-out sequence holds once back, free GPU blocks that takes)."""
        alloc = self.record(seq)
        if not alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is not swapped out")
        return self.swap.blocks_needed_in(alloc)

    def moved_in(self, seq, new_blocks) -> list[tuple[int, int]]:
        """swap_in's bookkeeping, once the policy handed out ``new_blocks``; returns the group's (cpu, gpu)
        copies."""
        mapping = self.swap.moved_in(self.records[seq.seq_id], self.pool, new_blocks)
        if self.sink is not None:
            self.sink.swapped_in(seq.seq_id, mapping)
        return mapping

    # ---- check_invariants -------------------------------------------------------------------------------
    def check(self) -> tuple[Counter, Counter]:
        """Check this group's records against themselves and their sequences; return the (GPU, CPU) references
        they hold (the coordinator checks the shared pools against every group's together)."""
        bs, gpu_refs, cpu_refs = self.block_size, Counter(), Counter()
        for seq_id, alloc in self.records.items():
            seq = alloc.seq
            if seq.seq_id != seq_id:
                _fail(f"the record of sequence {seq_id} holds sequence {seq.seq_id}")
            computed, drafts = seq.num_computed_tokens, seq.num_draft_tokens
            if type(computed) is not int or type(drafts) is not int or not 0 <= drafts <= computed <= alloc.num_slots \
                    or computed - drafts > seq.num_tokens or len(alloc.table) != -(-alloc.num_slots // bs):
                _fail(f"sequence {seq.seq_id}: {len(alloc.table)} blocks for {alloc.num_slots} slots, of which "
                      f"{computed!r} scheduled positions (num_computed_tokens), {drafts!r} of them drafts (it has "
                      f"{seq.num_tokens} tokens)")
            verified = computed - drafts
            if not seq.prefill_end <= seq.num_tokens:
                _fail(f"sequence {seq.seq_id}: prefills up to position {seq.prefill_end} of its {seq.num_tokens} "
                      "tokens")
            if self.prefix_caching and alloc.num_sealed != verified // bs:
                _fail(f"sequence {seq.seq_id}: {alloc.num_sealed} sealed blocks, but {verified // bs} have every "
                      "token scheduled and verified")
            # Only a fork sibling that accepted drafts this sequence rejected seals such a block.
            unverified = alloc.table[max(alloc.num_released, verified // bs):]
            if not alloc.on_cpu and any(self.pool.index.is_cached(block) and block not in alloc.forked_drafts
                                        for block in unverified):
                _fail(f"sequence {seq.seq_id}: a block holding a token still to be scheduled or verified is hittable")
            if any(b != NULL_BLOCK for b in alloc.table[:alloc.num_released]):
                _fail(f"sequence {seq.seq_id}: released entries must point at the null block")
            live = alloc.live_blocks()
            if len(set(live)) != len(live):
                _fail(f"sequence {seq.seq_id}'s table lists a block twice: {live}")
            (cpu_refs if alloc.on_cpu else gpu_refs).update(live)
            if not alloc.on_cpu:
                self._check_sealed(alloc)
                if isinstance(self.pool.index, UnitPrefixIndex):
                    self._check_partial(alloc)
            if alloc.cross is not None and alloc not in alloc.cross.members:
                _fail(f"sequence {seq.seq_id} reads a cross table that does not list it")
        return gpu_refs, cpu_refs

    def _check_sealed(self, alloc) -> None:
        """Every sealed block holds the sequence's own bytes (tokens, then its salt and keys) chained after the
        block before it: else a hit would read someone else's K/V. A block holding no sealed content (swapped
        back in, so not re-registered) is skipped, and so is its successor's parent."""
        if not alloc.num_sealed:
            return
        seq, bs, index = alloc.seq, self.block_size, self.pool.index
        span = self.span
        _, expected = self.own_blocks(*block_hashes(seq.token_array, bs // span, 0, alloc.num_sealed * span, None, None,
                                                    seq.key_bytes))
        parent = ROOT if not alloc.num_released else None  # None: not known here, not checked
        for i in range(alloc.num_released, alloc.num_sealed):
            block = alloc.table[i]
            if index.content_id(block) <= ROOT:
                parent = None
                continue
            if index.block_bytes[block] != expected[i] or parent not in (None, index.parent_content[block]):
                _fail(f"sequence {seq.seq_id}: sealed block {i} (GPU block {block}) holds other bytes or "
                      "another prefix than the sequence's own")
            parent = index.content_id(block)

    def _check_partial(self, alloc) -> None:
        """Every partial entry of a block this sequence holds is a run of the sequence's own tokens in that
        block, after the content of the block before it: else a partial hit would copy someone else's K/V. A block
        before it that holds no sealed content (swapped back in, so not re-registered) does not name the prefix:
        then the block's own sealed parent does (another sequence sharing the block indexed its units after it), or,
        the block unsealed too, the parent is not checked (as in ``_check_sealed``)."""
        seq, bs, index = alloc.seq, self.block_size, self.pool.index
        tokens, keys = memoryview(seq.token_array), seq.key_bytes or {}
        for i in range(alloc.num_released, len(alloc.table)):
            entry = index.partial_of.get(alloc.table[i])
            if entry is None:
                continue
            group, parent, suffix, held, _ = entry
            own = tokens[i * bs:i * bs + len(held) // 8].tobytes()
            before = index.content[alloc.table[i - 1]] if i else ROOT
            if before == NO_CONTENT and index.content[alloc.table[i]] > ROOT:  # (unsealed, its parent_content is stale)
                before = index.parent_content[alloc.table[i]]
            if group != self.group or own != held or suffix != self.own_keys(keys, i) or \
                    before not in (NO_CONTENT, parent):
                _fail(f"sequence {seq.seq_id}: block {i} (GPU block {alloc.table[i]}) is findable by units that are "
                      "not the sequence's own tokens after its own prefix")


def check_cross_tables(tables, records, block_size: int) -> tuple[Counter, Counter]:
    """Check a one-group manager's cross tables against its group's ``records``; return their (GPU, CPU) refs."""
    gpu_refs, cpu_refs = Counter(), Counter()
    live = set(map(id, records.values()))
    for table in tables:
        if any(id(member) not in live or member.cross is not table for member in table.members):
            _fail(f"the cross table of sequence {table.root.seq_id} lists sequences outside its group")
        if len(table.blocks) != -(-table.num_tokens // block_size):
            _fail(f"the cross table of sequence {table.root.seq_id} has {len(table.blocks)} blocks for "
                  f"{table.num_tokens} encoder tokens")
        (cpu_refs if table.on_cpu else gpu_refs).update(table.blocks)
    return gpu_refs, cpu_refs


def check_sequence(seq) -> Sequence:
    if not isinstance(seq, Sequence):
        raise InvalidArgumentError(f"expected a kvlab.Sequence, got {type(seq).__name__}")
    return seq


def _fail(message: str):
    raise InvariantViolation(message)
