"""The block manager: which physical KV blocks each sequence's tokens live in.

Engine ordering rule (the prefix cache relies on it): within a forward pass, every layer writes the new
tokens' K/V into their slots (``reshape_and_cache``) *before* that layer's attention reads the cache. That
is why a full block becomes hittable as soon as the step that writes its last token is scheduled (prompt
blocks when ``allocate`` returns, a decode block when ``append_slots`` seals it): a request that hits it in
the same step reads K/V that the same forward pass has already written. A block whose tokens are still to be
computed (the rest of a chunked prompt) is never hittable. The flip side, as in vLLM V1: once ``allocate`` or
``append_slots`` returned, the step that writes those slots must run before the sequence is freed.

Chunked prompts (vLLM V1's ``allocate_slots(request, num_new_tokens)``): ``allocate(seq, num_new_tokens=k)``
looks up prefix hits once and gives slots to the hits plus the next k prompt tokens; each later step's
``append_slots(seq, num_new_tokens=k)`` gives slots to the next k tokens without one (None: all of them,
today's whole-prompt and decode behaviour). How far the sequence got is its own ``seq.num_computed_tokens``:
these calls advance it, ``free`` resets it, ``check_invariants`` audits it (``num_scheduled_tokens(seq)`` reads it).

Sliding window W: a step whose first new token sits at position p attends to keys from p - W + 1 on, so a
block is released only once it lies wholly before that, at the start of the next step that moves p past it
(never while a query of the current step can still see it).

Lifecycle: ``allocate`` (RUNNING) -> ``append_token`` + ``append_slots`` per step -> ``free`` (FINISHED, or
WAITING with ``preempted=True``); ``fork`` shares a running sequence's blocks with a new child;
``swap_out`` (SWAPPED) / ``swap_in`` (RUNNING) move it to the CPU pool and back. The manager decides what is
valid from its own records, never from a status a caller set. Every public method holds one lock, so
threads may share a manager (each Sequence belongs to one thread at a time). A failed call changes nothing.

``BlockManager`` is a group's core and the coordinator of that one group: ``BlockManager(Coordinator, GroupCore,
VLLMV0Interface)``. The lifecycle calls (``allocate``, ``append_slots``, ``accept_drafts``, ``free``, ``fork``;
``swap_out`` / ``swap_in`` in kvlab.blocks.manager_swap) and the queries (kvlab.blocks.coordinator_queries) are
the coordinator's (kvlab.blocks.coordinator), written once for any number of groups; the group's halves of
them (plan first, bookkeeping after the coordinator's policy calls: admission, a step's growth, drafts'
verification, free, fork) and its own queries are ``GroupCore``'s (kvlab.blocks.group_core), which a hybrid
manager's groups are too. This module gives the coordinator its one group, itself, and its views of a sequence:
the sequence itself. vLLM V0's interface and the encoder-decoder cross-attention tables, which only a
one-group manager has, are kvlab.blocks.vllm_v0's. Its state is created in one place (kvlab.blocks.manager_state,
where its constructor lives), and every part reports its changes to the manager's one event sink
(kvlab.blocks.event_sink), when anything listens.
"""

from kvlab.blocks.coordinator import Coordinator
from kvlab.blocks.group_core import GroupCore
from kvlab.blocks.group_manager import GroupManager
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import MAX_BLOCKS, NULL_BLOCK
from kvlab.blocks.records import AllocStatus, PrefixCacheStats
from kvlab.blocks.vllm_v0 import VLLMV0Interface

__all__ = ["BlockManager", "AllocStatus", "PrefixCacheStats", "NULL_BLOCK", "MAX_BLOCKS"]


@serialized
class BlockManager(Coordinator, GroupCore, VLLMV0Interface):
    """The coordinator (kvlab.blocks.coordinator) of one KV cache group: itself, a ``GroupCore``. Its lifecycle
    calls (``allocate``, ``append_slots``, ``free``, ``fork``, swapping) and queries are the coordinator's,
    driving its own halves (kvlab.blocks.group_core) through ``GroupManager(self)``; a sequence is its own
    group's view."""

    def _join(self, *args, **kwargs) -> None:
        super()._join(*args, **kwargs)
        self._members = (GroupManager(self),)

    # ---- the coordinator's views of a sequence: itself, in the one group -----------------------------------
    def _views(self, seq):
        return (seq,)

    def _gpu_views(self, seq):
        self._on_gpu(seq)
        return (seq,)

    _new_views = _views

    def _fork_views(self, child, num_groups: int):
        return (child,)
