"""kvlab: learn and research paged KV caches (block manager, Triton kernels, cache-hit studies)."""

from kvlab._version import __version__
from kvlab.blocks import (POLICIES, AllocStatus, BlockManager, Event, EvictionPolicy, PrefixCacheStats, Sequence,
                          SequenceStatus)
from kvlab.errors import (EvictionPolicyError, InvalidArgumentError, InvariantViolation, KvlabError, NeedsGPUError,
                          OutOfBlocksError, SequenceStateError, TraceFormatError)

__all__ = [
    "AllocStatus", "BlockManager", "Event", "EvictionPolicy", "POLICIES", "PrefixCacheStats", "Sequence",
    "SequenceStatus", "EvictionPolicyError", "InvalidArgumentError", "InvariantViolation", "KvlabError",
    "NeedsGPUError", "OutOfBlocksError", "SequenceStateError", "TraceFormatError", "report",
]


def report() -> str:
    """Which kernel mode is active (GPU or Triton interpreter) and the versions in use."""
    from kvlab.device import report as device_report  # imports torch only when asked

    return device_report()
