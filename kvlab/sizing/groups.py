"""The KV cache config: how a model's layers share block ids and cache tensors, as vLLM V1 lays them out
(``KVCacheGroupSpec``, ``KVCacheTensor`` and ``KVCacheConfig`` in ``vllm/v1/kv_cache_interface.py``). The
engine builds its config once (``kvlab.engine.kv_cache.engine_kv_cache_groups``, then ``KVCacheConfig``) and
hands that one value to the block manager, the cache tensors and the runner; ``kvlab size`` builds the same
from a ``config.json``.

**Groups** (``kv_cache_groups``, vLLM's ``_get_kv_cache_groups_uniform_page_size``): the layers of one kind
(full attention, or one window size) are cut into groups of ``group_size`` layers, the fewest layers of any
kind (or the most, when no kind has 25% more layers than another). A kind with more layers makes several
groups, its i-th layer going to group ``i % n`` of its n, and a kind's last group may be short (vLLM's
padding layers). Every group has its own block table per sequence and its spec's hit, release and
blocks-per-request rules. A model with one kind of layer is one group of every layer.

**Tensors** (``KVCacheConfig.tensors``, vLLM's ``KVCacheTensor.shared_by``): ``group_size`` cache tensors,
tensor j shared by the j-th layer of every group. A block id is a page in each tensor, which the group holding
the id gives to its own layers; so a block id costs ``group_size`` pages (not one in every layer), and a block
a window group releases is memory any group can take.

**Blocks per request** at ``max_model_len`` tokens (vLLM's ``max_memory_usage_bytes``; each spec's
``blocks_per_request``): ``cdiv(max_model_len, block_size)`` in a full-attention group,
``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1`` in a sliding-window one. A
request holds them in every group; the maximum concurrency vLLM logs is the pool's blocks over their sum.

**State groups** (hybrid Mamba / linear-attention models, e.g. Qwen3-Next; vLLM's ``MambaSpec`` and
``HybridAttentionMambaModelConfig.verify_and_update_config``): the state layers are one more kind, grouped like
the others, whose layers keep one fixed state per request: a request holds one block in each state group. A
parallel hybrid (Falcon-H1: attention and a Mamba-2 mixer in every layer) is two cache layers per model layer,
as vLLM counts them: N full-attention layers and N state layers, so two groups of N sharing N tensors. A
state must fit in one page, so the attention block size grows, in multiples of the kernels' alignment
(``KERNEL_BLOCK_ALIGNMENT``), until an attention page holds a layer's state (``aligned_block_size``); the state
page is then padded to the attention page, so every group's pages stay equal.
"""

from dataclasses import dataclass
from functools import cached_property

from kvlab.blocks.kv_cache_groups import KVCacheSpec, MambaStateSpec, check_group_specs, spec_for
from kvlab.errors import InvalidArgumentError
from kvlab.sizing.kv_dtypes import is_float_format
from kvlab.sizing.layout import KVLayout
from kvlab.validation import check_int, is_int

#: vLLM cuts the kinds into groups of the most layers of any kind when none has this many times another's.
GROUP_SIZE_SLACK = 1.25
#: vLLM grows a hybrid state model's attention block size in multiples of this (FlashAttention's block sizes).
KERNEL_BLOCK_ALIGNMENT = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: its ``layers`` (the model's layer indices), its ``attention`` (``FullAttentionSpec()``
    or ``SlidingWindowSpec(W)``, which hold the hit, release and blocks-per-request rules) and its pages:
    ``block_size`` tokens of K and V for ``num_kv_heads`` heads of ``head_size`` elements, stored in
    ``cache_format`` (a ``kvlab.sizing.kv_dtypes.KV_FORMATS`` name); with ``mla_latent_dim`` (MLA) one latent
    row of that many elements per token instead. A state group (``MambaStateSpec()``) has the same pages, each
holding one layer's ``state_bytes`` (a request's state) padded to the page. ``prefix_match_unit``: the tokens
its prefix cache matches at (vLLM's ``hash_block_size``; None: whole blocks), a divisor of ``block_size``."""

    attention: KVCacheSpec
    layers: tuple
    block_size: int
    num_kv_heads: int
    head_size: int
    cache_format: str
    mla_latent_dim: int | None = None
    state_bytes: int | None = None
    prefix_match_unit: int | None = None

    def __post_init__(self):
        if isinstance(self.attention, MambaStateSpec):
            check_int("state_bytes", self.state_bytes, 1)
        else:
            check_group_specs([self.attention])
            if self.state_bytes is not None:
                raise InvalidArgumentError(f"only a MambaStateSpec() group keeps a state (state_bytes), got "
                                           f"state_bytes={self.state_bytes!r} for {self.attention!r}")
        check_int("block_size", self.block_size, 1)
        if self.prefix_match_unit is not None and (
                check_int("prefix_match_unit", self.prefix_match_unit, 1, self.block_size) and
                self.block_size % self.prefix_match_unit):
            raise InvalidArgumentError(f"prefix_match_unit must divide block_size {self.block_size}, got "
                                       f"{self.prefix_match_unit}")
        if not isinstance(self.layers, tuple) or not self.layers or not all(
                is_int(layer) and layer >= 0 for layer in self.layers):
            raise InvalidArgumentError(f"a KV cache group's layers must be a non-empty tuple of layer indices "
                                       f"(ints >= 0), got {self.layers!r}")
        self.layout  # checks the heads, the head size and the format
        if self.state_bytes is not None and self.state_bytes > self.page_bytes:
            raise InvalidArgumentError(f"a state of {self.state_bytes:,} B does not fit a page of {self.block_size} "
                                       f"tokens ({self.page_bytes:,} B): the block size must be at least "
                                       f"{aligned_block_size(self.state_bytes, self.layout.page_bytes(1), 1)}")

    @cached_property
    def layout(self) -> KVLayout:
        """The group's layers as a ``KVLayout``: what a token costs in each of them."""
        return KVLayout(self.num_kv_heads, self.head_size, self.cache_format,
                        (self.sliding_window,) * len(self.layers), self.mla_latent_dim)

    @property
    def sliding_window(self) -> int | None:
        return self.attention.sliding_window

    @property
    def page_bytes(self) -> int:
        """One page: ``block_size`` tokens' K and V in one layer."""
        return self.layout.page_bytes(self.block_size)

    @property
    def is_quantized(self) -> bool:
        """Whether K and V are stored in a quantized format (a ``KVQuantizer`` encodes and decodes them)."""
        return not is_float_format(self.cache_format)

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.attention.blocks_per_request(max_model_len, self.block_size, max_num_batched_tokens)


def aligned_block_size(state_bytes: int, token_page_bytes: int, block_size: int) -> int:
    """The attention block size vLLM picks for a hybrid state model (without prefix caching): the fewest
    multiples of ``KERNEL_BLOCK_ALIGNMENT`` tokens whose page (``token_page_bytes`` a token) holds a layer's
    ``state_bytes``, or ``block_size`` when that is already at least as large."""
    needed = KERNEL_BLOCK_ALIGNMENT * cdiv(state_bytes, KERNEL_BLOCK_ALIGNMENT * token_page_bytes)
    return max(block_size, needed)


def kv_cache_groups(layout: KVLayout, block_size: int, state_layers: tuple = (), state_bytes: int | None = None,
                    prefix_match_unit: int | None = None) -> tuple:
    """The model's KV cache groups, as vLLM V1 makes them (see the module docstring): full attention first,
    then the windows from the smallest, then the state layers, each kind's layers dealt out over its groups.
    ``layout`` describes the attention layers; ``state_layers`` (the cache layer indices of its Mamba /
    linear-attention layers, each keeping ``state_bytes``) are the others, the attention layers filling the
    remaining indices in order. Every group matches prefixes at ``prefix_match_unit`` (None: whole blocks)."""
    check_int("block_size", block_size, 1)
    state = set(state_layers)
    attention_layers = [layer for layer in range(layout.num_layers + len(state_layers)) if layer not in state]
    kinds = {spec_for(window): [attention_layers[i] for i, w in enumerate(layout.layer_windows) if w == window]
             for window in ([None] if layout.full_layers else []) + list(layout.windows)}
    if state_layers:
        kinds[MambaStateSpec()] = list(state_layers)
    fewest, most = min(map(len, kinds.values())), max(map(len, kinds.values()))
    group_size = most if most < fewest * GROUP_SIZE_SLACK else fewest
    groups = []
    for spec, layers in kinds.items():
        count = cdiv(len(layers), group_size)
        groups += [KVCacheGroupSpec(spec, tuple(layers[i::count]), block_size, layout.num_kv_heads, layout.head_dim,
                                    layout.dtype, layout.mla_latent_dim,
                                    state_bytes if isinstance(spec, MambaStateSpec) else None, prefix_match_unit)
                   for i in range(count)]
    return tuple(groups)


def bytes_per_block(groups) -> int:
    """What one block id costs: a page in each of the ``group_size`` tensors (the most layers of a group)."""
    return groups[0].page_bytes * max(len(group.layers) for group in groups)


@dataclass(frozen=True)
class KVCacheConfig:
    """The model's KV cache (vLLM's ``KVCacheConfig``): its ``groups`` (``KVCacheGroupSpec``, each with its
    layers) and ``num_blocks`` block ids, each a page of every one of the ``tensors``. Every group has the same
    pages (block size, heads, head size, format), as vLLM's one pool of equal pages needs."""

    groups: tuple
    num_blocks: int

    def __post_init__(self):
        if not isinstance(self.groups, tuple) or not self.groups or not all(
                isinstance(group, KVCacheGroupSpec) for group in self.groups):
            raise InvalidArgumentError(f"groups must be a non-empty tuple of KVCacheGroupSpec, got {self.groups!r}")
        pages = {(g.block_size, g.num_kv_heads, g.head_size, g.cache_format, g.mla_latent_dim, g.prefix_match_unit)
                 for g in self.groups}
        if len(pages) > 1:
            raise InvalidArgumentError(f"every KV cache group must have the same pages (block size, KV heads, head "
                                       f"size, format, MLA latent) and prefix_match_unit (one block manager "
                                       f"serves them), got {sorted(pages, key=str)}")
        layers = sorted(layer for group in self.groups for layer in group.layers)
        if layers != list(range(len(layers))):
            raise InvalidArgumentError(f"the groups must hold each of the model's layers 0 .. n - 1 once, got "
                                       f"{layers}")
        check_int("num_blocks", self.num_blocks, 0)

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def page_bytes(self) -> int:
        return self.groups[0].page_bytes

    @property
    def prefix_match_unit(self) -> int | None:
        return self.groups[0].prefix_match_unit

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    @property
    def group_size(self) -> int:
        """Layers per group (a short group is padded): how many cache tensors there are."""
        return max(len(group.layers) for group in self.groups)

    @property
    def padding_layers(self) -> int:
        return self.group_size * len(self.groups) - self.num_layers

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.groups)

    @property
    def tensors(self) -> tuple:
        """Tensor j -> the layers sharing it: the j-th layer of every group that has one."""
        return tuple(tuple(group.layers[j] for group in self.groups if j < len(group.layers))
                     for j in range(self.group_size))

    @property
    def layer_groups(self) -> tuple:
        """Layer -> the index of its group (whose block tables its attention reads)."""
        return layer_groups(self.groups)

    @property
    def layer_tensors(self) -> tuple:
        """Layer -> the index of the cache tensor it reads and writes."""
        where = {layer: tensor for tensor, layers in enumerate(self.tensors) for layer in layers}
        return tuple(where[layer] for layer in range(self.num_layers))

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks a request of ``max_model_len`` tokens holds, summed over the groups."""
        return sum(group.blocks_per_request(max_model_len, max_num_batched_tokens) for group in self.groups)


def layer_groups(groups) -> tuple:
    """Layer -> the index of its group in ``groups``."""
    where = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    return tuple(where[layer] for layer in range(len(where)))
