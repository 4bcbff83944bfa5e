"""Speculative decoding on the paged cache: draft tokens get slots, and only verified tokens are ever cached.

vLLM V1, for comparison (``KVCacheManager.allocate_slots`` and its scheduler): a step schedules a request's
draft tokens as new tokens (``num_new_tokens`` counts them; ``num_lookahead_tokens`` reserves slots for a
drafter that runs after the step), ``request.num_computed_tokens`` moves past them when the step is
scheduled, blocks are cached only up to ``request.num_tokens`` (``num_tokens_to_cache = min(num_computed +
num_new_tokens, request.num_tokens)``: drafts are not in the request's tokens, so a block holding one is
never hashed), and ``update_from_output`` rolls ``num_computed_tokens`` back by the number rejected; the
rejected positions keep their slots and the next step overwrites them.

kvlab does the same, with the counts on the sequence (kvlab.blocks.sequence) and explicit calls:

* ``append_slots(seq, num_draft_tokens=k)`` schedules the step's tokens (all of them: drafts follow the last
  token) and k draft positions after them: ``seq.num_computed_tokens`` moves past the drafts and
  ``seq.num_draft_tokens = k`` says how many of those positions are unverified. Drafts never enter the
  token list, and only blocks whose positions all lie below ``num_computed_tokens - num_draft_tokens`` are
  sealed: a block holding a draft is never hashed, published as ``BlockStored`` or hit.
  (``num_lookahead_slots`` keeps its meaning: slots with undefined content, not scheduled positions.)
* The forward pass writes the drafts' K/V into their slots and verifies them. The engine appends the accepted
  tokens with ``seq.append_token`` (the bonus token too, now or later), then calls ``accept_drafts(seq,
  num_accepted)``: the counter drops to the verified positions plus the accepted drafts, whose K/V is already
  in their slots (reused, never recomputed), and the blocks they complete are sealed at once, since the
  pass that wrote them has run (vLLM seals them at the next ``allocate_slots``). ``num_accepted=0``
  rejects them all. A sequence with drafts in flight gets no other step until they are verified.
* Rejected positions keep their slots (the table never shrinks) and the next step, which starts at the
  rolled-back counter, overwrites them.

Everything else follows from the counter. The sliding window releases blocks from a step's first query,
i.e. from the verified positions, so a rejected draft never releases a block the next step still sees. The
watermark, ``can_append_slots`` and swapping count draft slots like any others; recompute preemption frees
them all and resets the counters, and only verified blocks stay warm.

Fork with drafts in flight: the child shares the parent's blocks, drafts included (the pass writes the same
K/V for both: same tokens, same drafts), and each verifies them on its own. When one accepts more than the
other, it seals a block the other will write again (its rejected positions). The block holds verified K/V
for the sealer's bytes, so a hit on it is right; the other must only never write it in place. So a step
never writes a sealed block: shared, it is copied (copy-on-write as always); held by the writer alone (the
sealer freed it), it leaves the prefix cache first (``BlockPool.unseal``). ``Allocation.forked_drafts``
records which blocks a sibling may have sealed, for ``check_invariants``. A sequence that accepts the same
drafts as its sibling finds those blocks sealed already, with its own bytes, and chains through them.
"""

from itertools import groupby

from kvlab.blocks.hashing import hashes_to_seal, sealed_through
from kvlab.blocks.manager_state import ManagerState
from kvlab.blocks.prefix_index import ROOT
from kvlab.errors import InvalidArgumentError, SequenceStateError
from kvlab.validation import check_int


def check_unverified(seq) -> None:
    """A step may be scheduled only once the sequence's earlier drafts are verified."""
    if seq.num_draft_tokens:
        raise SequenceStateError(f"sequence {seq.seq_id} has {seq.num_draft_tokens} draft tokens in flight: "
                                 "accept_drafts(seq, num_accepted) before its next step")


def share_drafts(alloc, twin) -> None:
    """``fork`` of a sequence with drafts in flight: from the block of its first unverified position on, either
    may seal a block the other still writes."""
    seq = alloc.seq
    first = (seq.num_computed_tokens - seq.num_draft_tokens) // seq.block_size
    alloc.forked_drafts = twin.forked_drafts = alloc.forked_drafts | set(alloc.table[max(first, alloc.num_released):])


class SpeculativeDrafts(ManagerState):
    """One group's two halves of ``accept_drafts`` (the coordinator's call, kvlab.blocks.coordinator)."""

    def _plan_accept(self, seq, num_accepted):
        """(record, verified positions, (hashes, contents) of the blocks to seal or None): checked and hashed
        before anything changes, so a bad argument or a failing hash_fn leaves no trace."""
        alloc = self._on_gpu(seq)
        drafts = seq.num_draft_tokens
        if not drafts:
            raise SequenceStateError(f"sequence {seq.seq_id} has no draft tokens to verify")
        accepted = check_int("num_accepted", num_accepted, 0, drafts)
        verified = seq.num_computed_tokens - drafts + accepted
        if verified > seq.num_tokens:
            raise InvalidArgumentError(f"sequence {seq.seq_id} has {seq.num_tokens} tokens, but accepting "
                                       f"{accepted} drafts makes {verified} positions verified: append the "
                                       "accepted tokens first")
        bs = self.block_size
        if self.enable_prefix_caching and verified // bs > alloc.num_sealed:
            return alloc, verified, hashes_to_seal(seq, alloc.num_sealed, verified // bs, bs, self.hash_fn)
        return alloc, verified, None

    def _accept(self, alloc, verified: int, seals) -> None:
        """accept_drafts' bookkeeping (cannot fail): seal ``seals``, roll the counter to ``verified``."""
        seq = alloc.seq
        if seals is not None:
            self._seal_verified(alloc, *seals)
            sealed_through(seq, alloc.num_sealed)
        seq.num_computed_tokens, seq.num_draft_tokens = verified, 0

    def _seal_verified(self, alloc, hashes, contents) -> None:
        """Seal blocks ``num_sealed ..`` (one per hash), passing over those a fork sibling that accepted the same
        drafts sealed already: they hold these bytes, and the chain goes on through them."""
        pool, index, sink, first = self._pool, self._pool.index, self._sink, alloc.num_sealed
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
                    sink.stored(index, blocks[i:j], hashes[i:j], contents[i:j], hashes[i - 1] if i else alloc.last_hash)
            i = j
        alloc.num_sealed, alloc.last_hash = first + len(hashes), hashes[-1]
