"""Blocks one request needs, and how vLLM V1 packs a hybrid model's layers into KV cache groups.

**Blocks per request** at ``max_model_len`` tokens, per group (vLLM's ``max_memory_usage_bytes``): a
full-attention group needs ``cdiv(max_model_len, block_size)`` blocks; a sliding-window group
``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``: a chunk of up to
``max_num_batched_tokens`` new tokens attends to the ``window - 1`` before it, and the window may start
mid-block (the ``+ 1``). The maximum concurrency vLLM logs is the pool's blocks over their sum.

**vLLM's layout** (``kv_cache_utils._get_kv_cache_groups_uniform_page_size`` and
``get_kv_cache_config_from_groups``): layers of one kind (full, or one window size) are cut into groups of
``group_size`` layers, the fewest layers of any kind (or the most, when no kind has 25% more layers than
another), the last group of a kind padded with unused layers. There are ``group_size`` cache tensors, each
shared by one layer of every group, and each group gives its layers their own block ids. So one block id
costs ``group_size`` pages, and a request holds blocks in every group. kvlab's engine instead keeps one
tensor per layer for every block id (``kvlab.engine.hybrid``): a block id costs ``num_layers`` pages, and a
request holds blocks in one group per kind. For a model with one kind of layer both are the same.
"""

from dataclasses import dataclass

from kvlab.sizing.layout import KVLayout

ENGINE, VLLM = "kvlab engine", "vLLM V1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_per_request(window, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
    """Blocks one group (``window`` None: full attention) holds for a request of ``max_model_len`` tokens."""
    if window is None:
        return cdiv(max_model_len, block_size)
    return cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1


@dataclass(frozen=True)
class GroupLayout:
    """Block ids shared by ``groups`` (each group's window, None for full attention), each block id a page in
    ``pages_per_block`` layers."""

    name: str
    groups: tuple
    pages_per_block: int
    padding_layers: int = 0

    def bytes_per_block(self, layout: KVLayout, block_size: int) -> int:
        return layout.page_bytes(block_size) * self.pages_per_block

    def blocks_per_request(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        return sum(blocks_per_request(window, max_model_len, block_size, max_num_batched_tokens)
                   for window in self.groups)


def _kinds(layout: KVLayout) -> dict:
    """Window (None: full attention) -> number of layers, full attention first."""
    return ({None: layout.full_layers} if layout.full_layers else {}) | layout.windows


def engine_groups(layout: KVLayout) -> GroupLayout:
    """kvlab's engine: one group per kind of layer, every block id a page in every layer."""
    return GroupLayout(ENGINE, tuple(_kinds(layout)), layout.num_layers)


def vllm_groups(layout: KVLayout) -> GroupLayout:
    """vLLM V1: groups of ``group_size`` layers, each block id a page in ``group_size`` layers."""
    kinds = _kinds(layout)
    fewest, most = min(kinds.values()), max(kinds.values())
    group_size = most if most < fewest * 1.25 else fewest
    groups = tuple(window for window, count in kinds.items() for _ in range(cdiv(count, group_size)))
    padding = sum(cdiv(count, group_size) * group_size - count for count in kinds.values())
    return GroupLayout(VLLM, groups, group_size, padding)
