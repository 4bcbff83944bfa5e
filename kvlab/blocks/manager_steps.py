"""A scheduled step's growth (vLLM's ``append_slots``): a running sequence's next tokens get their slots.

``BlockManagerSteps`` is one of the parts ``BlockManager`` is built from (kvlab.blocks.manager); it reads only
the state its base (``kvlab.blocks.manager_state.ManagerState``) creates. A step is planned first
(kvlab.blocks.planning.plan_step: the blocks that left the sliding window, the shared blocks about to be
written, the new blocks), its seals hashed, then the eviction policy takes back the released blocks and
hands out the new ones in one transaction, and only then does the bookkeeping run, which cannot fail:
release, copy-on-write, new blocks, seal, and the sequence's progress counter. A hybrid manager's groups run
the same halves (kvlab.blocks.group_manager), with the policy calls of every group in one transaction.
"""

from typing import Optional

from kvlab.blocks.drafts import check_unverified
from kvlab.blocks.hashing import hashes_to_seal, sealed_through
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import NULL_BLOCK, ManagerState
from kvlab.blocks.planning import plan_step
from kvlab.blocks.sequence import Sequence
from kvlab.errors import OutOfBlocksError
from kvlab.validation import check_int


@serialized
class BlockManagerSteps(ManagerState):
    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                         num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> bool:
        """Whether ``append_slots`` with the same arguments fits now (a running sequence: no watermark)."""
        plan = self._plan_step(self._on_gpu(seq), num_lookahead_slots, num_new_tokens, num_draft_tokens)
        return plan.blocks_needed <= self._pool.num_free + len(plan.freed)

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                     num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> list[tuple[int, int]]:
        """Schedule a step: release the blocks that left the sliding window, give slots to the next
        ``num_new_tokens`` tokens that have none (None: all of them, i.e. every token appended by
        ``seq.append_token`` since the last step, or the rest of a chunked prompt), then to
        ``num_draft_tokens`` proposed tokens after the last one (verified by this step's forward pass, then
        ``accept_drafts``: kvlab.blocks.drafts) and to ``num_lookahead_slots`` more, and seal blocks whose last
        token is now scheduled, drafts aside (they become hittable at once: the ordering rule, kvlab.blocks.manager). A
        shared block about to be written is copied first; returns those copy-on-write (src, dst) pairs for
        ``copy_blocks``."""
        alloc = self._on_gpu(seq)
        plan = self._plan_step(alloc, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        pool = self._pool
        if plan.blocks_needed > pool.num_free + len(plan.freed):
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {plan.blocks_needed} free blocks, "
                                   f"{pool.num_free + len(plan.freed)} are free (check can_append_slots first)")
        seals = self._hashes_to_seal(alloc, plan, num_draft_tokens)
        with pool.transaction() as txn:
            txn.add(plan.freed, plan.freed_cached)
            taken = txn.pop(plan.blocks_needed)
        return self._apply_step(alloc, plan, num_lookahead_slots, taken, seals, num_draft_tokens)

    # ---- internals: the two halves --------------------------------------------------------------------
    def _plan_step(self, alloc, lookahead, num_new_tokens, num_drafts=0):
        check_int("num_lookahead_slots", lookahead, 0)
        check_int("num_draft_tokens", num_drafts, 0)
        check_unverified(alloc.seq)
        return plan_step(self._pool, alloc, self.block_size, self.spec, lookahead, num_new_tokens, num_drafts)

    def _hashes_to_seal(self, alloc, plan, num_drafts: int):
        """(hashes, contents) of the blocks the step ``plan`` seals (drafts aside: they may be rejected), or None:
        hashed before anything changes, so a failing hash_fn leaves no trace."""
        bs, stop = self.block_size, (plan.scheduled - num_drafts) // self.block_size
        if self.enable_prefix_caching and stop > alloc.num_sealed:
            return hashes_to_seal(alloc.seq, alloc.num_sealed, stop, bs, self.hash_fn)
        return None

    def _apply_step(self, alloc, plan, lookahead: int, taken, seals, num_drafts: int) -> list[tuple[int, int]]:
        """append_slots' bookkeeping, once the policy took back ``plan.freed`` and handed out ``taken`` (cannot
        fail): release what left the window, copy shared blocks about to be written, append new blocks and
        seal ``seals`` (``_hashes_to_seal``). Returns the copy-on-write pairs."""
        pool, table, sink, seq, n = self._pool, alloc.table, self._sink, alloc.seq, plan.scheduled
        pool.drop(plan.release, plan.freed)
        self._swap.forget_gpu(plan.freed)
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
                self._swap.forget_gpu([src])  # written in place: its CPU twin goes stale
        for block in fresh:
            table.append(block)
            if sink is not None:
                sink.appended(seq.seq_id, block)
        if seals is not None:
            hashes, contents = seals
            stop = alloc.num_sealed + len(hashes)
            sealed = table[alloc.num_sealed:stop]
            alloc.last_content = pool.seal(sealed, hashes, contents, alloc.last_content)
            if sink is not None:
                sink.stored(pool.index, sealed, hashes, contents, alloc.last_hash)
            alloc.num_sealed, alloc.last_hash = stop, hashes[-1]
            sealed_through(seq, alloc.num_sealed)
        alloc.num_computed = max(alloc.num_computed, seq.num_computed_tokens)  # a new step: the last one ran
        seq.num_computed_tokens, seq.num_draft_tokens = n, num_drafts
        alloc.num_slots = max(alloc.num_slots, n + lookahead)
        return pairs
