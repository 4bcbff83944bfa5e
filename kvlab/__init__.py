"""kvlab: learn and research paged KV caches (block manager, Triton kernels, cache-hit studies)."""

__version__ = "0.1.0"

from kvlab.block_manager import AllocStatus, BlockManager, PrefixCacheStats  # noqa: E402
from kvlab.block_pool import Event  # noqa: E402
from kvlab.errors import (  # noqa: E402
    InvalidArgumentError,
    InvariantViolation,
    KvlabError,
    NeedsGPUError,
    OutOfBlocksError,
    SequenceStateError,
    TraceFormatError,
)
from kvlab.eviction import POLICIES, EvictionPolicy  # noqa: E402
from kvlab.sequence import Sequence, SequenceStatus  # noqa: E402


def report() -> str:
    """Which kernel mode is active (GPU or Triton interpreter) and the versions in use."""
    from kvlab.device import report as device_report  # imports torch only when asked

    return device_report()
