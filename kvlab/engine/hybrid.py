"""Models whose layers attend differently (Qwen3 ``layer_types``: sliding_attention and full_attention).

The model's ``KVCacheConfig`` (``kvlab.sizing.groups``) lays its layers out as vLLM V1's hybrid allocator
does: the layers of each kind are cut into KV cache groups of ``group_size`` layers (a kind with more layers
makes several groups), every group has its own block table per sequence, and all groups draw their block ids
from one pool. There are ``group_size`` cache tensors (``PagedKVCache``), tensor j shared by the j-th layer
of every group, so a block id costs ``group_size`` pages, not one in every layer, and a block a window group
releases is memory any group can take again. A layer reads and writes its tensor at the page ids of its
group's table; a page id belongs to one group at a time, so the layers sharing a tensor never meet.

A model with one kind of layer (all full, or all with one window) is one group of every layer, a tensor each,
served by a single-group ``KVCacheManager``, windowed when its layers are; mixed models get one with a group per
KV cache group (two groups of one kind are two groups: their layers hold different K/V). The engine drives both
through one API (kvlab.blocks.manager), its scheduler writing the sequences' progress: per-group tables,
which the step and the runner read, and block moves (copy-on-write pairs of n > 1 forks, swap mappings) as one
list over all groups, each a page copied in every tensor.
"""

from kvlab.blocks.manager import KVCacheManager
from kvlab.errors import InvalidArgumentError
from kvlab.sizing import KVCacheConfig


def make_block_manager(config: KVCacheConfig, **options) -> KVCacheManager:
    """The block manager of ``config``'s groups, block size and blocks, for the engine's scheduler (which writes
    its sequences' progress): one group (windowed if it is), or a group per KV cache group."""
    specs = [group.attention for group in config.groups]
    options["prefix_match_unit"] = config.prefix_match_unit
    if len(specs) == 1:
        return KVCacheManager(config.num_blocks, config.block_size, sliding_window=specs[0].sliding_window, **options)
    if options.pop("num_offload_blocks", 0):
        raise InvalidArgumentError("num_offload_blocks: an offload tier is not supported for models with more than "
                                   "one kind of attention layer yet (full and sliding-window); pass 0")
    options.pop("offload_policy", None)
    options.pop("offload_admission", None)
    return KVCacheManager(config.num_blocks, config.block_size, groups=specs, **options)
