"""KV cache group specs: which kind of attention a group of layers does (vLLM V1's ``KVCacheSpec`` family).

A model that mixes layer kinds (Gemma 2/3: 5 sliding-window layers to 1 full; gpt-oss: alternating 128-token
windows and full attention) gets one group per kind, in the manner of vLLM V1's ``KVCacheGroupSpec``: every
group has its own block table per sequence and its own prefix-hit rule, and all groups draw equal-size pages
from one pool (``kvlab.blocks.hybrid_manager``). A spec says what a group's queries can see, which decides
which blocks it must keep and which cached blocks a hit needs:

    FullAttentionSpec       every key before the query: keeps every block; a hit needs every block before it
    SlidingWindowSpec(W)    the last W keys: blocks wholly before ``p - W + 1`` are released (to the pool,
                            still cached, as vLLM's SlidingWindowManager frees them)

Chunked-local attention (Llama 4: a query sees only its own chunk of C tokens) would be a third subclass; the
manager refuses specs it does not know, so adding one is a spec here plus its release rule in
``kvlab.blocks.planning``.
"""

from dataclasses import dataclass
from typing import Optional

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int


class KVCacheSpec:
    """What a group's attention sees; subclasses say it with ``sliding_window`` (None: everything)."""

    @property
    def sliding_window(self) -> Optional[int]:
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    @property
    def sliding_window(self) -> Optional[int]:
        return None


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    window: int

    def __post_init__(self):
        check_int("sliding window", self.window, 1)

    @property
    def sliding_window(self) -> Optional[int]:
        return self.window


KNOWN_SPECS = (FullAttentionSpec, SlidingWindowSpec)


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
