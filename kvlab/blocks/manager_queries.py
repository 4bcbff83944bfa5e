"""What one KV cache group answers about a sequence: its block table, its slots, and how much of a prompt the
group's prefix cache holds.

``GroupQueries`` is one of the parts ``BlockManager`` is built from; it reads only the state its base
(``kvlab.blocks.manager_state.ManagerState``) creates, and changes nothing. The coordinator's questions (the
pool's, and a sequence's across groups) are kvlab.blocks.coordinator_queries'; vLLM V0's own calls are in
``kvlab.blocks.vllm_v0``. ``get_num_cached_tokens`` stays here: V0 has it too, but kvlab's V1-style scheduler
asks it before a chunked ``allocate``.
"""

from kvlab.blocks.allocations import allocation_of, check_block_size_matches, check_sequence
from kvlab.blocks.hashing import prompt_blocks
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import ManagerState
from kvlab.blocks.prefix_index import ROOT
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int


@serialized
class GroupQueries(ManagerState):
    def _block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's block table in this group (CPU block ids while it is swapped out)."""
        return list(allocation_of(self, seq).table)

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
