"""KV cache group specs: which kind of attention a group of layers does (vLLM V1's ``KVCacheSpec`` family).

A model that mixes layer kinds (Gemma 2/3: 5 sliding-window layers to 1 full; gpt-oss: alternating 128-token
windows and full attention) gets one group per kind, in the manner of vLLM V1's ``KVCacheGroupSpec``: every
group has its own block table per sequence and its own prefix-hit rule, and all groups draw equal-size pages
from one pool (``kvlab.blocks.manager``). A spec says what a group's queries can see, which decides
which blocks it must keep and which cached blocks a hit needs:

    FullAttentionSpec       every key before the query: keeps every block; a hit needs every block before it
    SlidingWindowSpec(W)    the last W keys: blocks wholly before ``p - W + 1`` are released (to the pool,
                            still cached, as vLLM's SlidingWindowManager frees them)

A spec is also its group's planner: its release rule (``first_live_block``: which leading blocks no query can
see any more) and what that rule costs at the peak (``least_peak_blocks``) are its methods, so the block manager
asks the spec instead of branching on the kind of attention (kvlab.blocks.group_manager). Its hit rule is the
release rule at the first query: the prefix lookup is the same for every spec (cached blocks from block 0
on, each chain verified), and of a hit of h blocks a group keeps those from ``first_live_block(h *
block_size)`` on; the others prove the chain without being pinned. Its ``blocks_per_request`` is what vLLM
reserves for one request of ``max_model_len`` tokens in the group (``max_memory_usage_bytes``), the rule
``kvlab size`` and the engine's pool sizing count with.

A spec here is only the kind of attention, so a block manager is made with ``FullAttentionSpec()`` and
``SlidingWindowSpec(W)``; a group's block size, pages and layers are in its ``KVCacheGroupSpec``
(``kvlab.sizing.groups``), which holds one of these.

Chunked-local attention (Llama 4: a query sees only its own chunk of C tokens) would be a third subclass with
its own release rule; the manager refuses specs it does not know, so adding one is a spec here and its name
in ``KNOWN_SPECS``.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int


class KVCacheSpec:
    """What a group's attention sees: ``sliding_window`` (None: everything), ``kind`` (vLLM's KVCacheSpecKind
    value), and the rules the block manager plans with."""
    kind: ClassVar[str]

    @property
    def sliding_window(self) -> Optional[int]:
        raise NotImplementedError

    def first_live_block(self, first_query: int, block_size: int) -> int:
        """The release rule: how many leading blocks no query at position >= ``first_query`` can see."""
        raise NotImplementedError

    def least_peak_blocks(self, scheduled: int, num_tokens: int, block_size: int, lookahead: int) -> int:
        """The fewest blocks a sequence must hold at once to give positions ``scheduled .. num_tokens - 1``
        (``scheduled < num_tokens``) their slots later, however they are chunked: the step that computes
        position p holds at least blocks ``first_live_block(p) .. ceil((p + 1 + lookahead) / block_size) - 1``,
        and steps of one token hold exactly that."""
        raise NotImplementedError

    def blocks_per_request(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The blocks a request of ``max_model_len`` tokens holds at most in the group, prefilled in chunks of
        up to ``max_num_batched_tokens`` tokens (vLLM's ``max_memory_usage_bytes`` over the page size)."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    kind: ClassVar[str] = "full_attention"

    @property
    def sliding_window(self) -> Optional[int]:
        return None

    def first_live_block(self, first_query: int, block_size: int) -> int:
        return 0  # every key stays visible

    def least_peak_blocks(self, scheduled: int, num_tokens: int, block_size: int, lookahead: int) -> int:
        return -(-(num_tokens + lookahead) // block_size)  # the whole sequence, at its last token

    def blocks_per_request(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        return -(-max_model_len // block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self):
        check_int("sliding window", self.window, 1)

    @property
    def sliding_window(self) -> Optional[int]:
        return self.window

    def first_live_block(self, first_query: int, block_size: int) -> int:
        # A query at position p sees keys p - W + 1 .. p: blocks wholly before first_query - W + 1 can go.
        return max(0, first_query - self.window + 1) // block_size

    def least_peak_blocks(self, scheduled: int, num_tokens: int, block_size: int, lookahead: int) -> int:
        # The count grows until p = W - 1 and is periodic (period block_size) from there on, so the last
        # block_size positions reach its maximum.
        return max(-(-(p + 1 + lookahead) // block_size) - self.first_live_block(p, block_size)
                   for p in range(max(scheduled, num_tokens - block_size), num_tokens))

    def blocks_per_request(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        # A chunk of new tokens attends to the window - 1 keys before it, and the window may start mid-block.
        return -(-min(self.window - 1 + max_num_batched_tokens, max_model_len) // block_size) + 1


@dataclass(frozen=True)
class MambaStateSpec(KVCacheSpec):
    """A group of Mamba or linear-attention layers (vLLM's ``MambaSpec``): each layer keeps one fixed-size state
    per request (its convolution's last inputs and its SSM / recurrent state), however long the request, so a
    request holds one block in the group. Only ``kvlab size`` uses it: the block manager does not plan these
    groups (it is not in ``KNOWN_SPECS``), and the engine does not serve such models."""
    kind: ClassVar[str] = "mamba"

    @property
    def sliding_window(self) -> Optional[int]:
        return None

    def blocks_per_request(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        return 1  # the state, in one page padded to the attention page (no prefix-cache states kept)


KNOWN_SPECS = (FullAttentionSpec, SlidingWindowSpec)


def spec_for(sliding_window: Optional[int]) -> KVCacheSpec:
    """The spec of a single-group ``BlockManager(sliding_window=...)``."""
    return FullAttentionSpec() if sliding_window is None else SlidingWindowSpec(sliding_window)


def check_group_specs(specs) -> tuple:
    """The groups as a tuple of known specs, or InvalidArgumentError saying what is allowed."""
    allowed = "a non-empty list of FullAttentionSpec() and SlidingWindowSpec(window) (kvlab.blocks.kv_cache_groups)"
    if isinstance(specs, (str, bytes)) or not hasattr(specs, "__iter__"):
        raise InvalidArgumentError(f"groups must be {allowed}, got {type(specs).__name__}")
    specs = tuple(specs)
    if not specs:
        raise InvalidArgumentError(f"groups must be {allowed}, got an empty list")
    for i, spec in enumerate(specs):
        if type(spec) not in KNOWN_SPECS:
            raise InvalidArgumentError(f"groups[{i}] is {spec!r}; each group must be one of {allowed}")
    return specs
