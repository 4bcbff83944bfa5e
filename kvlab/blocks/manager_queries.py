"""What the block manager answers about its state: pool counts, ref counts, block tables, slot mappings, and
how much of a prompt the prefix cache holds.

``BlockManagerQueries`` is one of the parts ``BlockManager`` is built from; it reads only the state its base
(``kvlab.blocks.manager_state.ManagerState``) creates, and changes nothing. vLLM V0's own calls are in
``kvlab.blocks.vllm_v0``. ``get_num_cached_tokens`` stays here: V0 has it too, but kvlab's V1-style scheduler
asks it before a chunked ``allocate``.
"""

from typing import Optional

from kvlab.blocks.allocations import allocation_of, check_block_size_matches, check_sequence
from kvlab.blocks.hashing import prompt_blocks
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import ManagerState
from kvlab.blocks.planning import least_peak_blocks
from kvlab.blocks.prefix_index import ROOT
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int


@serialized
class BlockManagerQueries(ManagerState):
    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_evictions(self) -> int:
        """Cached prefixes dropped because their block was reused for new content."""
        return self._pool.evictions

    @property
    def tier_stats(self):
        """Hits per tier (GPU, offload tier, miss) in blocks and tokens: a ``TierHitStats``; None without a tier."""
        return self._tier.stats if self._tier is not None else None

    @property
    def num_offload_blocks(self) -> int:
        """Slots of the offload tier (a shared tier's, which other managers use too); 0 without one."""
        return self._tier.num_slots if self._tier is not None else 0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks a prefix lookup can hit now (in use or free-but-warm)."""
        return self._pool.index.num_cached

    @property
    def num_cpu_blocks(self) -> int:
        return self._swap.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._swap.num_free

    @property
    def usable_blocks(self) -> int:
        """The most blocks one sequence can hold at once: the pool less the null block (reserved when there is
        a sliding window) and the watermark. ``can_allocate`` says NEVER for a prompt that needs more."""
        return self._usable - self._watermark_blocks

    def blocks_for_prompt(self, num_tokens: int, num_new_tokens: Optional[int] = None) -> int:
        """Blocks a prompt of ``num_tokens`` tokens must hold at once when none of it is cached, its first step
        computing ``num_new_tokens`` tokens (None: all of them, as V0 scheduling does) and later steps the rest,
        however chunked. ``can_allocate`` says NEVER for such a prompt exactly when this is more than
        ``usable_blocks``. (A prefix hit starts the first step later, which moves the blocks a window holds.)"""
        n = check_int("num_tokens", num_tokens, 1)
        first = n if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1, n)
        # plan_allocation's peak_blocks with no hits: the first step's blocks, or the most a later step needs.
        return max(-(-first // self.block_size), least_peak_blocks(first, n, self.block_size, self.spec, 0))

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref[check_int("block id", block_id, 0, self.num_blocks - 1)]

    def cpu_ref_count(self, block_id: int) -> int:
        """How many swapped-out table entries point at CPU block ``block_id``."""
        return self._swap.ref[check_int("CPU block id", block_id, 0, self._swap.num_blocks - 1)]

    def block_hash(self, block_id: int) -> Optional[int]:
        return self._pool.index.block_hash(check_int("block id", block_id, 0, self.num_blocks - 1))

    def is_cached(self, block_id: int) -> bool:
        """Whether a prefix lookup can hit this block now (it may be in use or free-but-warm)."""
        return self._pool.index.is_cached(check_int("block id", block_id, 0, self.num_blocks - 1))

    def free_block_ids(self) -> list[int]:
        """Free GPU blocks, in the order they will be reused."""
        return list(self._pool.policy)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's block table (CPU block ids while it is swapped out)."""
        return list(allocation_of(self, seq).table)

    def is_swapped(self, seq: Sequence) -> bool:
        """Whether an allocated sequence's blocks are in the CPU pool (its table then holds CPU ids)."""
        return allocation_of(self, seq).on_cpu

    def num_released_blocks(self, seq: Sequence) -> int:
        """Leading table entries the sliding window released (they point at the null block on the GPU)."""
        return allocation_of(self, seq).num_released

    def num_scheduled_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens have slots: their K/V is written by now or by the step just scheduled
        (vLLM V1's ``request.num_computed_tokens``, which its scheduler advances when it schedules a step).
        The tokens after them (the rest of a chunked prompt, or tokens appended since) still need a step.
        ``seq.num_computed_tokens`` itself, for a sequence allocated here."""
        allocation_of(self, seq)  # allocated here: else the counter is not this manager's to report
        return seq.num_computed_tokens

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of positions start..end-1; -1 where the sliding window
        released the block (only positions no query of this or a later step can see). Only positions with a
        slot (scheduled ones and lookahead slots) can be asked for."""
        alloc, bs = self._on_gpu(seq), self.block_size
        table = alloc.table
        if not (check_int("start", start, 0) <= check_int("end", end, 0) <= alloc.num_slots):
            raise InvalidArgumentError(f"need 0 <= start <= end <= {alloc.num_slots} (positions with slots), got "
                                       f"start={start!r}, end={end!r}")
        released = alloc.num_released
        return [-1 if p // bs < released else table[p // bs] * bs + p % bs for p in range(start, end)]

    # The hybrid manager's per-group API, for one group: the engine reads every manager through it.
    @property
    def groups(self) -> tuple:
        """Each KV cache group's attention spec (kvlab.blocks.kv_cache_groups): this manager's one."""
        return (self.spec,)

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """``[get_block_table(seq)]``: one KV cache group."""
        return [self.get_block_table(seq)]

    def slot_mappings(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """``[slot_mapping(seq, start, end)]``: one KV cache group."""
        return [self.slot_mapping(seq, start, end)]

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s leading full blocks found in the prefix cache now (at most all but the last
        token, as ``allocate`` would hit); works for allocated and waiting sequences."""
        check_block_size_matches(self, check_sequence(seq))
        if not self.enable_prefix_caching or seq.num_tokens == 0:
            return 0
        hashes, contents = prompt_blocks(seq, self.block_size, self.hash_fn)
        limit, pool = (seq.num_tokens - 1) // self.block_size, self._pool
        hits = pool.index.lookup(hashes, contents, limit, ROOT, self.group)
        tier_hits = pool.tier.lookup(hashes, contents, limit, hits, pool.index) if pool.tier is not None else ()
        return (len(hits) + len(tier_hits)) * self.block_size
