"""Models whose layers attend differently (Qwen3 ``layer_types``: sliding_attention and full_attention).

Each kind of layer is a KV cache group (``kvlab.blocks.kv_cache_groups``) with a block table per sequence,
all drawing equal-size pages from one pool, as vLLM V1's hybrid allocator does. Every layer keeps its own
cache tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (``PagedKVCache``) and reads the page
ids of its group's table, so a page given to one group is unused in the other groups' tensors: simple, and
what vLLM does for one group per kind, at the price of one page per layer for every page id.

A model with one kind of layer (all full, or all with one window) keeps the single-group ``BlockManager``,
windowed when its layers are. Mixed models get ``EngineHybridManager``: the ``HybridBlockManager`` plus the
few single-group queries the schedulers and the step loop ask. Its block moves (copy-on-write pairs of n > 1
forks, swap mappings) come as one list over all groups: page ids are unique across groups (one pool, one CPU
pool), and a move copies its page in every layer's cache tensor, where the other groups' layers never read
that page, so every group's K/V arrives where its layers look.
"""

from kvlab.blocks.hybrid_manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.manager import BlockManager
from kvlab.engine.config import ModelConfig
from kvlab.errors import InvalidArgumentError


def group_specs(config: ModelConfig) -> tuple[list, list[int]]:
    """The model's KV cache groups (full attention first, then one per window) and each layer's group."""
    windows = sorted({w for w in config.layer_windows if w is not None})
    specs = ([FullAttentionSpec()] if None in config.layer_windows else []) + [SlidingWindowSpec(w) for w in windows]
    return specs, [[spec.sliding_window for spec in specs].index(w) for w in config.layer_windows]


def make_block_manager(config: ModelConfig, num_blocks: int, block_size: int, **options):
    """A ``BlockManager`` (windowed if every layer is) for one kind of layer, else an ``EngineHybridManager``."""
    specs, _ = group_specs(config)
    if len(specs) == 1:
        return BlockManager(num_blocks, block_size, sliding_window=specs[0].sliding_window, **options)
    if options.pop("num_offload_blocks", 0):
        raise InvalidArgumentError("num_offload_blocks: an offload tier is not supported for models with more than "
                                   "one kind of attention layer yet (full and sliding-window); pass 0")
    options.pop("offload_policy", None)
    options.pop("offload_admission", None)
    return EngineHybridManager(num_blocks, block_size, groups=specs, **options)


class EngineHybridManager(HybridBlockManager):
    """``HybridBlockManager`` answering as one ``BlockManager`` where the engine asks about a sequence as a
    whole; the scheduler reads each group's tables through ``block_tables`` / ``slot_mappings`` into the step."""

    def take_tier_moves(self) -> list:
        return []  # no offload tier for hybrid models (make_block_manager refuses one)

    def get_block_table(self, seq) -> list[int]:
        """Every block the sequence holds, in any group (the null block 0 where a window released one)."""
        return [block for table in self.block_tables(seq) for block in table]

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        """Every group's slots for positions start..end-1, one group after another."""
        return [slot for slots in self.slot_mappings(seq, start, end) for slot in slots]

    def append_slots(self, seq, num_lookahead_slots: int = 0, *, num_new_tokens=None,
                     num_draft_tokens: int = 0) -> list[tuple[int, int]]:
        """Copy-on-write pairs of every group in one list (see the module docstring)."""
        return _flat(super().append_slots(seq, num_lookahead_slots, num_new_tokens=num_new_tokens,
                                          num_draft_tokens=num_draft_tokens))

    def swap_out(self, seq) -> list[tuple[int, int]]:
        """Every group's (gpu, cpu) copies in one list."""
        return _flat(super().swap_out(seq))

    def swap_in(self, seq) -> list[tuple[int, int]]:
        """Every group's (cpu, gpu) copies in one list."""
        return _flat(super().swap_in(seq))


def _flat(per_group: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [pair for group in per_group for pair in group]
