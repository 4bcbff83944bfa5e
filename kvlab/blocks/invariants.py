"""``check_invariants()``: an O(pool) audit of the manager's bookkeeping, for tests (kvlab.blocks.coordinator
runs it over every group, then the shared pools).

The manager's own records are checked here, and the sequence's progress counter (``seq.num_computed_tokens``,
which the manager advances but does not own) against them: every allocation belongs to its sequence, holds
exactly the blocks its scheduled positions and lookahead slots need, has sealed (with prefix caching) exactly
the blocks whose tokens are all scheduled and verified (drafts aside) and no block holding an unscheduled or
unverified one is hittable, points released entries at the null block and never lists a block twice, and
every sealed block in its table holds that sequence's own bytes (tokens, then its salt and keys) chained
after the block before it; every cross table's members are live allocations of its group. The reference
counts these records imply are then handed to each component, which checks itself against them
(``BlockPool.check``: ref counts, free set, and through ``PrefixIndex.check`` the prefix cache map and content
ids; ``SwapSpace.check``: CPU ref counts, free list, twin links).
"""

from collections import Counter

from kvlab.blocks.prefix_index import ROOT
from kvlab.blocks.hashing import block_hashes
from kvlab.blocks.sequence import allocation_record, key_bytes, token_buffer
from kvlab.errors import InvariantViolation


def _fail(message: str):
    raise InvariantViolation(message)


def check_records(allocations, cross_tables, pool, block_size, prefix_caching) -> tuple[Counter, Counter]:
    """Check one group's records; return the (GPU, CPU) references they hold, block -> table entries (the
    coordinator adds up its groups' before checking the pools they share)."""
    gpu_refs, cpu_refs = Counter(), Counter()
    for alloc in allocations:
        seq = alloc.seq
        if allocation_record(seq) is not alloc:
            _fail(f"sequence {seq.seq_id} does not point at the allocation that holds it")
        # The sequence's progress counters, checked against this record: positions < computed have slots, the
        # last `drafts` of them unverified (kvlab.blocks.drafts).
        computed, drafts = seq.num_computed_tokens, seq.num_draft_tokens
        if type(computed) is not int or type(drafts) is not int or not 0 <= drafts <= computed <= alloc.num_slots \
                or computed - drafts > seq.num_tokens or len(alloc.table) != -(-alloc.num_slots // block_size):
            _fail(f"sequence {seq.seq_id}: {len(alloc.table)} blocks for {alloc.num_slots} slots, of which "
                  f"{computed!r} scheduled positions (num_computed_tokens), {drafts!r} of them drafts (it has "
                  f"{seq.num_tokens} tokens)")
        verified = computed - drafts
        if not alloc.num_computed <= verified:
            _fail(f"sequence {seq.seq_id}: {alloc.num_computed} positions marked computed but only {verified} "
                  "scheduled and verified")
        if not seq.prefill_end <= seq.num_tokens:
            _fail(f"sequence {seq.seq_id}: prefills up to position {seq.prefill_end} of its {seq.num_tokens} tokens")
        if prefix_caching and alloc.num_sealed != verified // block_size:
            _fail(f"sequence {seq.seq_id}: {alloc.num_sealed} sealed blocks, but {verified // block_size} "
                  "have every token scheduled and verified")
        # Only a fork sibling that accepted drafts this sequence rejected seals such a block (kvlab.blocks.drafts).
        unverified = alloc.table[max(alloc.num_released, verified // block_size):]
        if not alloc.on_cpu and any(pool.index.is_cached(block) and block not in alloc.forked_drafts
                                    for block in unverified):
            _fail(f"sequence {seq.seq_id}: a block holding a token still to be scheduled or verified is hittable")
        if any(b != 0 for b in alloc.table[:alloc.num_released]):
            _fail(f"sequence {seq.seq_id}: released entries must point at the null block")
        live = alloc.live_blocks()
        if len(set(live)) != len(live):
            _fail(f"sequence {seq.seq_id}'s table lists a block twice: {live}")
        (cpu_refs if alloc.on_cpu else gpu_refs).update(live)
        if not alloc.on_cpu:
            _check_sealed(alloc, pool, block_size)
        if alloc.cross is not None and alloc not in alloc.cross.members:
            _fail(f"sequence {seq.seq_id} reads a cross table that does not list it")
    for table in cross_tables:
        if not table.members <= allocations or any(member.cross is not table for member in table.members):
            _fail(f"the cross table of sequence {table.root.seq_id} lists sequences outside its group")
        if len(table.blocks) != -(-table.num_tokens // block_size):
            _fail(f"the cross table of sequence {table.root.seq_id} has {len(table.blocks)} blocks for "
                  f"{table.num_tokens} encoder tokens")
        (cpu_refs if table.on_cpu else gpu_refs).update(table.blocks)
    return gpu_refs, cpu_refs


def _check_sealed(alloc, pool, block_size) -> None:
    """A hit hands a sequence K/V computed for the bytes its block holds: were they not the sequence's own
    (another tenant's salt, another image's key), it would read someone else's K/V. A block that holds no
    sealed content (swapped back in, so not re-registered) is skipped, and so is its successor's parent."""
    if not alloc.num_sealed:
        return
    _, expected = block_hashes(token_buffer(alloc.seq), block_size, 0, alloc.num_sealed, None, None,
                               key_bytes(alloc.seq))
    parent = ROOT if not alloc.num_released else None  # None: not known here, not checked
    index = pool.index
    for i in range(alloc.num_released, alloc.num_sealed):
        block = alloc.table[i]
        if index.content_id(block) <= ROOT:
            parent = None
            continue
        if index.block_bytes[block] != expected[i] or parent not in (None, index.parent_content[block]):
            _fail(f"sequence {alloc.seq.seq_id}: sealed block {i} (GPU block {block}) holds other bytes or "
                  "another prefix than the sequence's own")
        parent = index.content_id(block)
