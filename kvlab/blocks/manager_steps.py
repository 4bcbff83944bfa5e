"""A scheduled step's growth (vLLM's ``append_slots``): a running sequence's next tokens get their slots.

``GroupSteps`` is one of the parts a group's core is built from (kvlab.blocks.group_core); it reads only the
state its base (``kvlab.blocks.manager_state.ManagerState``) creates. It holds one group's two halves of
``append_slots``, which the coordinator (kvlab.blocks.coordinator) calls for every group. A step is planned first
(kvlab.blocks.planning.plan_step: the blocks that left the sliding window, the shared blocks about to be
written, the new blocks), its seals hashed, then the eviction policy takes back the released blocks and
hands out the new ones in one transaction, and only then does the bookkeeping run, which cannot fail:
release, copy-on-write, new blocks, seal, and the sequence's progress counter. The policy calls between the
halves are the coordinator's, every group's in one transaction.
"""

from kvlab.blocks.drafts import check_unverified
from kvlab.blocks.hashing import hashes_to_seal, sealed_through
from kvlab.blocks.manager_state import NULL_BLOCK, ManagerState
from kvlab.blocks.planning import plan_step
from kvlab.validation import check_int


class GroupSteps(ManagerState):
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
            alloc.last_content = pool.seal(sealed, hashes, contents, alloc.last_content, self.group)
            if sink is not None:
                sink.stored(pool.index, sealed, hashes, contents, alloc.last_hash)
            alloc.num_sealed, alloc.last_hash = stop, hashes[-1]
            sealed_through(seq, alloc.num_sealed)
        alloc.num_computed = max(alloc.num_computed, seq.num_computed_tokens)  # a new step: the last one ran
        seq.num_computed_tokens, seq.num_draft_tokens = n, num_drafts
        alloc.num_slots = max(alloc.num_slots, n + lookahead)
        return pairs
