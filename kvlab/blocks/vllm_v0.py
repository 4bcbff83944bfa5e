"""vLLM V0's block-space-manager interface, on top of kvlab's own manager: the calls V0's scheduler and model
runner make that kvlab's lifecycle does not need, and the encoder-decoder cross-attention tables.

``VLLMV0Interface`` is one of the parts ``BlockManager`` is built from (it reads only the state its base,
``kvlab.blocks.manager_state.ManagerState``, creates, and the cross-attention tables it creates itself), so
code written against V0's ``BlockSpaceManager`` calls them on a ``BlockManager``. A hybrid manager's groups
have neither: the tables are a one-group manager's. Nothing here allocates a decoder block: the V0 calls note
which steps ran and when blocks were used, and report hit rates; the cross-attention calls read and free a
request group's table. The table itself (kvlab.blocks.cross_attention) is made by
``allocate(seq, encoder_seq)``: its blocks are taken in the same atomic step as the decoder's, so the
coordinator (kvlab.blocks.coordinator) asks the hooks below (``_cross_blocks``, ``_attach_cross``,
``_cross_tables``), which a hybrid manager answers with none.
"""

from kvlab.blocks.cross_attention import CrossTables
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import ManagerState
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_number


@serialized
class VLLMV0Interface(ManagerState):
    def _join(self, *args, **kwargs) -> None:
        super()._join(*args, **kwargs)
        self._cross = CrossTables(self.block_size)  # encoder-decoder cross-attention tables, by root sequence

    # ---- computed blocks and recency ---------------------------------------------------------------------
    def mark_blocks_as_computed(self, seq: Sequence) -> None:
        """The step that wrote ``seq``'s new slots ran. (``append_slots`` implies it for the step before.) Draft
        tokens still to be verified are not computed (kvlab.blocks.drafts)."""
        alloc = self._on_gpu(seq)
        alloc.num_computed = seq.num_computed_tokens - seq.num_draft_tokens

    def access_all_blocks_in_seq(self, seq: Sequence, now: float) -> None:
        """``seq``'s blocks were used at time ``now``; LRU orders the blocks it was told about by it."""
        alloc = self._on_gpu(seq)
        now = check_number("now", now)
        with self._pool.transaction() as txn:
            txn.access(alloc.live_blocks(), now)

    def get_common_computed_block_ids(self, seqs) -> list[int]:
        """The longest run of leading blocks that every sequence in ``seqs`` holds and whose K/V is computed:
        what a batched prefill of the group can skip."""
        if isinstance(seqs, (Sequence, str, bytes)) or not isinstance(seqs, (list, tuple)):
            raise InvalidArgumentError(f"seqs must be a list of Sequence (e.g. [seq]), got {type(seqs).__name__}")
        common = None
        for seq in seqs:
            alloc = self._on_gpu(seq)
            computed = alloc.table[:alloc.num_computed // self.block_size]
            if common is None:
                common = computed
            else:
                same = next((i for i, (a, b) in enumerate(zip(common, computed)) if a != b), None)
                common = common[:min(len(common), len(computed)) if same is None else same]
        return list(common or [])

    def get_prefix_cache_hit_rate(self, device="gpu") -> float:
        """Block hit rate of ``allocate``'s lookups on ``device`` ("gpu" or "cpu", or an enum named so), 0.0
        before any lookup reached it: on "gpu" GPU hits / full blocks queried; on "cpu" the offload tier's
        hits / the full blocks that missed on the GPU. -1.0 where there is no prefix
        cache (prefix caching off, or "cpu" without an offload tier: the swap pool caches nothing), as in
        vLLM. Recomputations after preemption are not lookups here (``PrefixCacheStats``); neither rate can
        reach 1.0, since a prompt's last token is always computed."""
        name = str(getattr(device, "name", device)).lower()
        if name not in ("gpu", "cpu"):
            raise InvalidArgumentError(f"device must be 'gpu' or 'cpu', got {device!r}")
        if not self.enable_prefix_caching or (name == "cpu" and self._tier is None):
            return -1.0
        if name == "cpu":
            tier = self._tier.stats
            asked = tier.tier_hit_blocks + tier.miss_blocks
            return tier.tier_hit_blocks / asked if asked else 0.0
        return self.stats.hit_blocks / self.stats.queried_blocks if self.stats.queried_blocks else 0.0

    # ---- encoder-decoder: the group's cross-attention table ----------------------------------------------
    def get_cross_block_table(self, seq: Sequence) -> tuple:
        """The encoder's blocks of ``seq``'s group (CPU ids while swapped out), for any member or its root."""
        return tuple(self._cross.table_of(self, seq).blocks)

    def free_cross(self, seq: Sequence) -> None:
        """Free the cross-attention table of ``seq``'s group (call it with any live member, or with the
        sequence that was allocated with the encoder, even after it was freed)."""
        self._cross.free(self._cross.table_of(self, seq), self._pool, self._swap)

    # ---- the coordinator's hooks: the tables are made and checked with allocate and check_invariants -------
    def _cross_blocks(self, seq, encoder_seq) -> int:
        """New blocks ``allocate(seq, encoder_seq)`` takes for a cross table (raises if the call is not valid)."""
        return self._cross.blocks_for(seq, encoder_seq)

    def _attach_cross(self, seq, encoder_seq, blocks) -> None:
        """The just-allocated ``seq`` gets its request group's table: a new one of ``blocks`` (with
        ``encoder_seq``), or the one it kept from before a recompute preemption."""
        self._cross.attach(self._alloc(seq), encoder_seq, blocks)

    def _cross_tables(self):
        return self._cross
