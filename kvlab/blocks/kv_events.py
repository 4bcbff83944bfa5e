"""KV cache events: what enters and leaves a manager's prefix cache, in vLLM's event schema.

A router that places requests on many replicas cannot read their pools; vLLM V1 workers publish what they
cache instead (``vllm/distributed/kv_events.py``), and NVIDIA Dynamo, llm-d and the AIBrix gateway route on
those events. ``BlockManager(..., kv_events=True)`` and ``HybridBlockManager(..., kv_events=True)`` publish
the same three kinds:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
                group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)
        a run of consecutive full blocks became hittable (``parent_block_hash``: the block before the run,
        None at a prompt's start; ``token_ids``: the run's tokens, block after block)
    BlockRemoved(block_hashes, medium, group_idx)   blocks stopped being hittable (evicted: reused for new content)
    AllBlocksCleared()                   ``reset_prefix_cache`` forgot every prefix (of every group)

Field names and meanings are vLLM's. kvlab names adapters by key, not by id, so ``lora_id`` and ``lora_name``
are None; ``extra_keys`` (one entry per block, the non-token inputs of its hash) holds each block's encoded
salt, adapter and keys (``kvlab.blocks.block_keys``) in hex, None for a block without, and is None when no
block of the run has any.
vLLM's hybrid-allocator fields: ``group_idx`` is the KV cache group the blocks belong to (the index into the
hybrid manager's ``groups``), on both BlockStored and BlockRemoved; a store also describes its group with
``kv_cache_spec_kind`` (``"full_attention"`` or ``"sliding_window"``, vLLM's KVCacheSpecKind values) and
``kv_cache_spec_sliding_window`` (the window in tokens, None for full attention), so a consumer learns the
groups from the stream. A block's hash is the same in every group (vLLM's events carry the plain block hash
and ``group_idx``; its pool keys blocks by hash and group, ``BlockHashWithGroupId``), so the same prompt
stores the same hashes once per group. A ``HybridBlockManager`` fills all three; a single-group
``BlockManager`` leaves them None and its events encode without them (vLLM's structs omit fields at their
None default), as before.
``medium`` (vLLM's field) says which tier: ``"GPU"`` for the pool's prefix cache, ``"CPU"`` for the offload tier
(``BlockManager(num_offload_blocks=N)``, kvlab.blocks.offload_tier), whose stores name no parent (as vLLM's
offloading connector's) and always carry one block. The swap space holds swapped sequences, never events.

Events are exact: applying them in order to a set of hashes (``CachedHashes``) gives, after every manager
call, the set of hashes a prefix lookup can hit, per group for a hybrid manager (each group is its own
namespace of the prefix index: a lookup in one group never hits another's). A duplicate of a block already
cached (kvlab keeps one block per hash and group) is not stored twice, so a ``BlockRemoved`` always removes
a hash that was stored in its group.

Subscribers: ``kv_events.subscribe(callback)`` calls ``callback(event)`` for every event;
``kv_events.subscribe()`` returns a subscription to iterate (each event once, in order);
``kv_events.write_jsonl(path_or_text_file)`` writes one JSON object per line, tagged ``"type"`` as msgspec
encodes vLLM's tagged structs (the target is checked, and a path opened, when it is called). Each returns a
``Subscription``; ``close()`` (or a ``with`` block) ends it.

Delivery (why subscribers cannot hurt the manager). vLLM's workers publish events from a queue, after the
scheduler's state change, so a slow or broken consumer never touches the scheduler. kvlab does the same in
one thread: during a manager call the events only go into a queue (a hybrid manager's groups share one
queue, delivered by the hybrid manager alone); when the outermost public call has finished its whole state
change (and released the manager's lock), the queue is delivered, each event to every subscriber in
subscription order, then the next event. So a subscriber always sees a consistent
manager, may call the manager itself (its call's events are delivered after the current ones), and may
close itself or another subscription mid-delivery without anyone else missing an event.

A subscriber that raises is **dropped**: it is closed, its exception is kept in ``subscription.error``,
and a ``KVEventSubscriberWarning`` names it. Every other subscriber still gets that event and all later
ones, and the manager call that produced it returns normally (its change is done and consistent; raising
would tell the caller it failed). Dropping, not skipping one event, because a consumer that missed an event
holds a wrong index from then on: a router must re-subscribe and rebuild, as a vLLM consumer that lost
its ZMQ stream replays it. ``write_jsonl`` to a file whose write fails later (a full disk) is dropped the
same way.
"""

import threading
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvlab.blocks.event_sink import EventSink
from kvlab.blocks.kv_event_subscribers import Subscription, jsonl_writer
from kvlab.errors import InvalidArgumentError

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list
    parent_block_hash: Optional[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    # Each block's tokens as int64 bytes, as the manager holds them: decoding 512 ints per block for every
    # event would cost a fleet replay seconds, and a router never reads them. ``token_ids`` decodes on demand.
    token_bytes: tuple = field(default=(), repr=False)

    @property
    def token_ids(self) -> list[int]:
        return array("q", b"".join(self.token_bytes)).tolist()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list
    medium: Optional[str] = MEDIUM_GPU
    group_idx: Optional[int] = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_dict(event: KVCacheEvent) -> dict:
    """The event as vLLM's tagged struct encodes it: ``{"type": "BlockStored", "block_hashes": [...], ...}``.
    The group fields appear only on a hybrid manager's events (vLLM omits them at their None default), so a
    single-group manager's dicts and JSONL lines are what they were before groups existed."""
    if isinstance(event, BlockStored):
        out = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
               "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
               "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
               "lora_name": event.lora_name, "extra_keys": event.extra_keys}
        if event.group_idx is not None:
            out.update(group_idx=event.group_idx, kv_cache_spec_kind=event.kv_cache_spec_kind,
                       kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window)
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


class CachedHashes:
    """A subscriber that rebuilds a replica's cached block hashes from its events (a router's index).

    ``hashes``: a single-group manager's (events without ``group_idx``); ``groups[g]``: group g's of a hybrid
    manager; ``cpu_hashes``: its offload tier's (events with ``medium="CPU"``). One set per group, not one set
    of (group, hash) pairs: a router matches a request group by group (the hit is the shortest), so each match
    probes plain ints in one set, and the single-group index stays the set it always was."""

    def __init__(self):
        self.hashes: set[int] = set()
        self.groups: dict[int, set[int]] = {}
        self.cpu_hashes: set[int] = set()

    def __call__(self, event: KVCacheEvent) -> None:
        if type(event) is AllBlocksCleared:
            self.hashes.clear()
            self.groups.clear()
            self.cpu_hashes.clear()
            return
        group = event.group_idx
        if event.medium == MEDIUM_CPU:
            cached = self.cpu_hashes
        else:
            cached = self.hashes if group is None else self.groups.setdefault(group, set())
        if type(event) is BlockStored:
            cached.update(event.block_hashes)
        else:
            cached.difference_update(event.block_hashes)

    def prefix_match(self, hashes: list[int], limit: int, group: Optional[int] = None) -> int:
        """How many of the first ``limit`` chained ``hashes`` are cached (in ``group``, for a hybrid manager),
        stopping at the first miss: the blocks a lookup would hit (a chained hash names its whole prefix)."""
        cached = self.hashes if group is None else self.groups.get(group, set())
        for i in range(min(limit, len(hashes))):
            if hashes[i] not in cached:
                return i
        return min(limit, len(hashes))


class KVEventPublisher(EventSink):
    """A manager's event stream (``manager.kv_events``), one consumer of its event sink
    (kvlab.blocks.event_sink): the sink's ``stored``, ``evicted`` and ``cleared`` reports are queued as
    vLLM's events (with no subscriber they return at once), and the manager calls ``deliver()`` when its
    outermost public call has finished (``kvlab.blocks.locking``).

    ``groups``: a hybrid manager's group specs (kvlab.blocks.kv_cache_groups), None for a single group. With
    groups, each member reports ``stored`` with its group (``GroupSink``), and the publisher remembers which
    group each cached block is in, whether or not anyone subscribes: the pool's ``evicted`` names blocks only,
    and a subscriber that joins later must still learn the group of a block stored before it joined."""

    def __init__(self, block_size: int, groups=None):
        self.block_size = block_size
        # The group fields of each group's BlockStored; [{}] (no fields) for a single-group manager.
        self._stored_fields = [{}] if groups is None else [
            dict(group_idx=g, kv_cache_spec_sliding_window=spec.sliding_window, kv_cache_spec_kind=spec.kind)
            for g, spec in enumerate(groups)]
        self._group_of: Optional[dict[int, int]] = None if groups is None else {}  # cached block -> its group
        self._subscriptions: list[Subscription] = []
        # Events of finished state changes, not yet delivered. A deque: appends (under the manager's lock) and
        # popleft (in deliver) are atomic, so producers never wait for subscribers.
        self.queue: deque = deque()
        self._delivery_lock = threading.RLock()  # one delivery at a time, so every subscriber sees one order
        self._delivering = False

    def subscribe(self, callback: Optional[Callable[[KVCacheEvent], None]] = None) -> Subscription:
        if callback is not None and not callable(callback):
            raise InvalidArgumentError(f"callback must be callable as callback(event), got {callback!r}")
        return self._add(Subscription(self._subscriptions, callback))

    def write_jsonl(self, path_or_file) -> Subscription:
        """Write every event from now on as one JSON line to a path (opened now, closed by ``close()``) or to
        an open text file (left open). Raises InvalidArgumentError, subscribing nothing, if the target cannot
        be written: not a str/os.PathLike path or a text file, a missing folder, a directory, a closed file."""
        write, on_close = jsonl_writer(path_or_file, event_dict)
        return self._add(Subscription(self._subscriptions, write, on_close))

    def _add(self, subscription: Subscription) -> Subscription:
        with self._delivery_lock:  # not while an event is half-delivered: a new subscriber starts at the next
            self._subscriptions.append(subscription)
        return subscription

    def deliver(self) -> None:
        """Deliver the queued events, oldest first, each to every open subscriber. A callback's own manager
        calls queue more events, which this loop delivers after the current ones (never nested)."""
        with self._delivery_lock:
            if self._delivering:
                return
            self._delivering = True
            try:
                queue = self.queue
                while queue:
                    event = queue.popleft()
                    for subscription in tuple(self._subscriptions):  # a snapshot: close() may run meanwhile
                        subscription.receive(event)
            finally:
                self._delivering = False

    # ---- the sink's reports, under the manager's lock ------------------------------------------------------
    def stored(self, index, blocks, hashes, contents, parent_hash: Optional[int], group: int = 0) -> None:
        """``blocks`` were just sealed with ``hashes`` (chained after ``parent_hash``) in ``group``; those the
        prefix cache registered (not duplicates of a cached block) are stored, one event per consecutive run."""
        if self._group_of is not None:
            self._group_of.update((block, group) for block in blocks if index.is_cached(block))
        if not self._subscriptions:
            return
        fields = self._stored_fields[group]
        start = None
        for i, block in enumerate([*blocks, None]):
            if block is not None and index.is_cached(block):
                start = i if start is None else start
            elif start is not None:
                run, width = contents[start:i], 8 * self.block_size
                # A keyed block's bytes are its tokens then its keys' encoding (kvlab.blocks.block_keys).
                keys = [content[width:].hex() or None for content in run]
                self.queue.append(BlockStored(hashes[start:i], hashes[start - 1] if start else parent_hash,
                                              self.block_size, extra_keys=keys if any(keys) else None,
                                              token_bytes=tuple(content[:width] for content in run), **fields))
                start = None

    def evicted(self, blocks, hashes, contents) -> None:
        if self._group_of is None:
            if self._subscriptions:
                self.queue.append(BlockRemoved(hashes))
            return
        groups = [self._group_of.pop(block) for block in blocks]
        if self._subscriptions:  # one event per run of blocks of one group, in eviction order
            start = 0
            for i in range(1, len(blocks) + 1):
                if i == len(blocks) or groups[i] != groups[start]:
                    self.queue.append(BlockRemoved(hashes[start:i], group_idx=groups[start]))
                    start = i

    def offloaded(self, block, slot, block_hash, content) -> None:
        if self._subscriptions:
            width = 8 * self.block_size
            key = content[width:].hex() or None
            self.queue.append(BlockStored([block_hash], None, self.block_size, medium=MEDIUM_CPU,
                                          extra_keys=[key] if key else None, token_bytes=(content[:width],)))

    def tier_removed(self, slots, hashes) -> None:
        if self._subscriptions:
            self.queue.append(BlockRemoved(list(hashes), medium=MEDIUM_CPU))

    def cleared(self) -> None:
        if self._group_of is not None:
            self._group_of.clear()
        if self._subscriptions:
            self.queue.append(AllBlocksCleared())
