"""Models whose layers attend differently (Qwen3 ``layer_types``: sliding_attention and full_attention).

Each kind of layer is a KV cache group (``kvlab.blocks.kv_cache_groups``) with a block table per sequence,
all drawing equal-size pages from one pool, as vLLM V1's hybrid allocator does. Every layer keeps its own
cache tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (``PagedKVCache``) and reads the page
ids of its group's table, so a page given to one group is unused in the other groups' tensors: simple, and
what vLLM does for one group per kind, at the price of one page per layer for every page id.

A model with one kind of layer (all full, or all with one window) keeps the single-group ``BlockManager``,
windowed when its layers are; mixed models get a ``HybridBlockManager``. The engine drives both through one
API (kvlab.blocks.hybrid_manager): per-group tables, which the step and the runner read, and block moves
(copy-on-write pairs of n > 1 forks, swap mappings) as one list over all groups.
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
    """A ``BlockManager`` (windowed if every layer is) for one kind of layer, else a ``HybridBlockManager``."""
    specs, _ = group_specs(config)
    if len(specs) == 1:
        return BlockManager(num_blocks, block_size, sliding_window=specs[0].sliding_window, **options)
    if options.pop("num_offload_blocks", 0):
        raise InvalidArgumentError("num_offload_blocks: an offload tier is not supported for models with more than "
                                   "one kind of attention layer yet (full and sliding-window); pass 0")
    options.pop("offload_policy", None)
    options.pop("offload_admission", None)
    return HybridBlockManager(num_blocks, block_size, groups=specs, **options)
