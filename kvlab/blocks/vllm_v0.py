"""vLLM V0's block-space-manager calls, as a thin layer over kvlab's ``BlockManager`` for the notebooks and code
that use them: ``BlockSpaceManager`` is a ``BlockManager`` (one KV cache group) that also answers
``mark_blocks_as_computed``, ``get_common_computed_block_ids``, ``access_all_blocks_in_seq`` and
``get_prefix_cache_hit_rate``. It reads the manager only through its public calls, and keeps the one thing V0
tracks that kvlab's lifecycle does not need: how far each sequence's K/V is confirmed written (the V0 "computed"
mark: the hits at ``allocate``, then everything scheduled before each new step, or when marked).
"""

from kvlab.blocks.manager import BlockManager
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError, InvariantViolation

__all__ = ["BlockSpaceManager"]


class BlockSpaceManager(BlockManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._computed: dict[int, int] = {}  # seq_id -> positions whose K/V is confirmed written
        self._seqs: dict[int, Sequence] = {}  # seq_id -> the sequence, to audit the marks

    # ---- the lifecycle calls, keeping the computed marks --------------------------------------------------
    def allocate(self, seq: Sequence, *args, **kwargs):
        admitted = super().allocate(seq, *args, **kwargs)
        self._computed[seq.seq_id], self._seqs[seq.seq_id] = admitted.num_cached_tokens, seq
        return admitted

    def append_slots(self, seq: Sequence, *args, **kwargs):
        ran = seq.num_computed_tokens  # a new step: the last one ran (marked once the call succeeds)
        copies = super().append_slots(seq, *args, **kwargs)
        self._computed[seq.seq_id] = max(self._computed[seq.seq_id], ran)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self._computed[child.seq_id], self._seqs[child.seq_id] = self._computed[parent.seq_id], child

    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        super().free(seq, preempted=preempted)
        del self._computed[seq.seq_id], self._seqs[seq.seq_id]

    def check_invariants(self) -> None:
        super().check_invariants()
        for seq_id, computed in self._computed.items():
            seq = self._seqs[seq_id]
            verified = seq.num_computed_tokens - seq.num_draft_tokens
            if computed > verified:
                raise InvariantViolation(f"sequence {seq_id}: {computed} positions marked computed but only "
                                         f"{verified} scheduled and verified")

    # ---- vLLM V0's calls --------------------------------------------------------------------------------
    def mark_blocks_as_computed(self, seq: Sequence) -> None:
        """The step that wrote ``seq``'s new slots ran (``append_slots`` implies it for the step before). Draft
        tokens still to be verified are not computed."""
        self.slot_mappings(seq, 0, 0)  # allocated here and on the GPU, or SequenceStateError
        self._computed[seq.seq_id] = seq.num_computed_tokens - seq.num_draft_tokens

    def access_all_blocks_in_seq(self, seq: Sequence, now: float) -> None:
        """``seq``'s blocks were used at time ``now``; LRU orders the blocks it was told about by it."""
        self.touch(seq, now)

    def get_common_computed_block_ids(self, seqs) -> list[int]:
        """The longest run of leading blocks that every sequence in ``seqs`` holds and whose K/V is computed:
        what a batched prefill of the group can skip."""
        if isinstance(seqs, (Sequence, str, bytes)) or not isinstance(seqs, (list, tuple)):
            raise InvalidArgumentError(f"seqs must be a list of Sequence (e.g. [seq]), got {type(seqs).__name__}")
        common = None
        for seq in seqs:
            self.slot_mappings(seq, 0, 0)
            computed = self.get_block_table(seq)[:self._computed[seq.seq_id] // self.block_size]
            if common is None:
                common = computed
            else:
                same = next((i for i, (a, b) in enumerate(zip(common, computed)) if a != b), None)
                common = common[:min(len(common), len(computed)) if same is None else same]
        return list(common or [])

    def get_prefix_cache_hit_rate(self, device="gpu") -> float:
        """Block hit rate of ``allocate``'s lookups on ``device`` ("gpu" or "cpu", or an enum named so), 0.0
        before any lookup reached it: on "gpu" GPU hits / full blocks queried; on "cpu" the offload tier's hits
        / the full blocks that missed on the GPU. -1.0 where there is no prefix cache (prefix caching off, or
        "cpu" without an offload tier: the swap pool caches nothing), as in vLLM. Recomputations after
        preemption are not lookups here; neither rate can reach 1.0 (a prompt's last token is always computed)."""
        name = str(getattr(device, "name", device)).lower()
        if name not in ("gpu", "cpu"):
            raise InvalidArgumentError(f"device must be 'gpu' or 'cpu', got {device!r}")
        if not self.enable_prefix_caching or (name == "cpu" and self.tier_stats is None):
            return -1.0
        if name == "cpu":
            tier = self.tier_stats
            asked = tier.tier_hit_blocks + tier.miss_blocks
            return tier.tier_hit_blocks / asked if asked else 0.0
        return self.stats.hit_blocks / self.stats.queried_blocks if self.stats.queried_blocks else 0.0
