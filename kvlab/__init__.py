"""kvlab: learn and research paged KV caches (block manager, Triton kernels, cache-hit studies)."""

from kvlab.block_manager import AllocStatus, BlockManager, PrefixCacheStats
from kvlab.block_pool import Event
from kvlab.errors import (
    InvalidArgumentError,
    InvariantViolation,
    KvlabError,
    NeedsGPUError,
    OutOfBlocksError,
    SequenceStateError,
    TraceFormatError,
)
from kvlab.eviction import POLICIES, EvictionPolicy
from kvlab.sequence import Sequence, SequenceStatus

__version__ = "0.1.0"
__all__ = [
    "AllocStatus", "BlockManager", "Event", "EvictionPolicy", "POLICIES", "PrefixCacheStats", "Sequence",
    "SequenceStatus", "InvalidArgumentError", "InvariantViolation", "KvlabError", "NeedsGPUError",
    "OutOfBlocksError", "SequenceStateError", "TraceFormatError", "report",
]


def report() -> str:
    """Which kernel mode is active (GPU or Triton interpreter) and the versions in use."""
    from kvlab.device import report as device_report  # imports torch only when asked

    return device_report()
