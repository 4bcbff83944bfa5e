"""What the manager reports: the one event sink every part reports to, the teaching Event log, vLLM's KV
cache events (BlockStored, BlockRemoved, AllBlocksCleared) and their subscribers, and sampled residency metrics.
"""

from array import array
from collections import deque
from dataclasses import dataclass, field
import io
import json
import os
import random
import threading
import time
from typing import Callable, NamedTuple, Optional
import warnings

import numpy as np

from kvlab.blocks.records import Event
from kvlab.errors import InvalidArgumentError, KVEventSubscriberWarning
from kvlab.validation import check_number


# ==== the event sink and the teaching log =============================================================================
# The one sink of what the block manager does: the manager and its pool report each change to it, and its
# consumers turn the reports into their own records.
#
# Two consumers ship with kvlab: ``EventLog``, the teaching ``Event`` records of ``record_events=True``
# (timelines, notebooks), and ``KVEventPublisher`` (kvlab.blocks.events), vLLM's KV cache events of
# ``kv_events=True`` for routers. A second cache tier would be a third: ``evicted`` hands it every cached
# block's hash and content as the pool drops it. ``make_sink`` combines the consumers that are on; with none, the
# manager holds None, and each report site costs one ``is None`` check.
#
# Timing: every report is made under the manager's lock, right after the part of the state change it
# describes, so a consumer can read the pool as it is then (a KV ``stored`` needs to know which blocks the
# prefix cache registered). Consumers only record; nothing outside kvlab runs during a call: the KV events
# reach their subscribers after the outermost call finished (kvlab.blocks.manager).

class EventSink:
    """What the manager and its pool report, in the order it happens. Every report is a no-op here: a consumer
    overrides those it keeps. Lists and ids are the caller's, valid during the report: copy what you keep."""

    # ---- a sequence's steps (BlockManager) -------------------------------------------------------------------
    def looked_up(self, seq_id: int, hits: list, misses: list) -> None:
        """``allocate``'s prefix hits, then the new blocks it gives the prompt (before they are filled)."""

    def allocated(self, seq_id: int) -> None:
        """``allocate`` finished (its blocks are filled and sealed)."""

    def copied(self, seq_id: int, dst: int, src: int) -> None:
        """``append_slots`` copies the shared block ``src`` into ``dst`` before writing it (copy-on-write)."""

    def appended(self, seq_id: int, block: int) -> None:
        """``append_slots`` gives the table a new block at its end."""

    def freed(self, seq_id: int) -> None:
        """``free`` dropped the sequence's references."""

    def forked(self, child_id: int, parent_id: int) -> None:
        """``fork`` shares the parent's blocks with the child."""

    def swapped_out(self, seq_id: int, mapping: list) -> None:
        """``swap_out``'s (gpu, cpu) copies."""

    def swapped_in(self, seq_id: int, mapping: list) -> None:
        """``swap_in``'s (cpu, gpu) copies."""

    # ---- blocks (BlockPool) ----------------------------------------------------------------------------------
    def released(self, blocks) -> None:
        """These blocks became free (the last reference to each was dropped)."""

    def sealed(self, blocks: list) -> None:
        """These blocks now hold sealed content new to the pool (duplicates of a cached prefix excluded)."""

    def evicted(self, blocks: list, hashes: list, contents: list) -> None:
        """Cached blocks reused for new content, as they were just before: block i held ``contents[i]`` (its
        tokens as int64 bytes, then its keys' encoding: kvlab.blocks.sequence) under hash ``hashes[i]``.
        What a second cache tier needs to keep them. Three aligned lists, not a record per block: a tuple
        per evicted block made a KV-event replay a third slower."""

    # ---- the offload tier (OffloadTier) ------------------------------------------------------------------------
    def offloaded(self, block: int, slot: int, block_hash: int, content: bytes) -> None:
        """The evicted GPU ``block`` is kept in the tier's CPU ``slot``, under ``block_hash`` with ``content``."""

    def tier_removed(self, slots: list, hashes: list) -> None:
        """The tier dropped these entries (its replacement policy's victims) to make room."""

    def promoted(self, slots: list, blocks: list) -> None:
        """``allocate`` copies the tier's ``slots`` into the GPU ``blocks`` (a ``stored`` report follows)."""

    # ---- the prefix cache as a router sees it ------------------------------------------------------------------
    def stored(self, index, blocks: list, hashes: list, contents: list, parent_hash: Optional[int],
               group: int = 0) -> None:
        """``blocks`` were just sealed with ``hashes`` and ``contents``, chained after ``parent_hash`` (None
        at a prompt's start), in KV cache ``group`` (0 but in a hybrid manager's groups: ``GroupSink``);
        ``index.is_cached(block)`` tells which the pool's prefix index registered."""

    def cleared(self) -> None:
        """``reset_prefix_cache`` forgot every prefix."""


class EventLog(EventSink):
    """The teaching records: one ``Event`` per step, appended to ``events`` (``manager.events``)."""

    def __init__(self):
        self.events: list[Event] = []

    def looked_up(self, seq_id, hits, misses):
        self.events.extend(Event("hit", seq_id, block) for block in hits)
        self.events.extend(Event("miss", seq_id, block) for block in misses)

    def allocated(self, seq_id):
        self.events.append(Event("allocate", seq_id))

    def copied(self, seq_id, dst, src):
        self.events.append(Event("cow", seq_id, dst, src))

    def appended(self, seq_id, block):
        self.events.append(Event("append", seq_id, block))

    def freed(self, seq_id):
        self.events.append(Event("free", seq_id))

    def forked(self, child_id, parent_id):
        self.events.append(Event("fork", child_id, other=parent_id))

    def swapped_out(self, seq_id, mapping):
        self.events.extend(Event("swap_out", seq_id, gpu, cpu) for gpu, cpu in mapping)

    def swapped_in(self, seq_id, mapping):
        self.events.extend(Event("swap_in", seq_id, gpu, cpu) for cpu, gpu in mapping)

    def released(self, blocks):
        self.events.extend(Event("release", block_id=block) for block in blocks)

    def sealed(self, blocks):
        self.events.extend(Event("seal", block_id=block) for block in blocks)

    def evicted(self, blocks, hashes, contents):
        self.events.extend(Event("evict", block_id=block) for block in blocks)

    def offloaded(self, block, slot, block_hash, content):
        self.events.append(Event("offload", block_id=block, other=slot))

    def tier_removed(self, slots, hashes):
        self.events.extend(Event("tier_evict", other=slot) for slot in slots)

    def promoted(self, slots, blocks):
        self.events.extend(Event("promote", block_id=block, other=slot) for slot, block in zip(slots, blocks))


class Fanout(EventSink):
    """Several consumers behind one sink: each report goes to each of them, in the order given."""

    def __init__(self, consumers):
        self.consumers = tuple(consumers)


def _forward(name: str):
    def report(self, *args):
        for consumer in self.consumers:
            getattr(consumer, name)(*args)
    report.__name__ = name
    return report


for _name in [name for name in vars(EventSink) if not name.startswith("_")]:
    setattr(Fanout, _name, _forward(_name))


class GroupSink(EventSink):
    """One KV cache group's view of a hybrid manager's sink (kvlab.blocks.manager): each group's
    ``BlockManager`` reports here, and every report passes on unchanged but ``stored``, which gains the group.
    (The shared pool reports to the sink itself: an eviction's group is the one its block was stored in.)"""

    def __init__(self, sink: EventSink, group: int):
        self.sink, self.group = sink, group

    def stored(self, index, blocks, hashes, contents, parent_hash, group=0):
        self.sink.stored(index, blocks, hashes, contents, parent_hash, self.group)


def _pass_on(name: str):
    def report(self, *args):
        getattr(self.sink, name)(*args)
    report.__name__ = name
    return report


for _name in [name for name in vars(EventSink) if not name.startswith("_") and name != "stored"]:
    setattr(GroupSink, _name, _pass_on(_name))


def make_sink(*consumers: Optional[EventSink]) -> Optional[EventSink]:
    """The sink for the consumers that are on (None entries are off): None, the one consumer, or a Fanout."""
    on = [consumer for consumer in consumers if consumer is not None]
    if len(on) < 2:
        return on[0] if on else None
    return Fanout(on)


# ==== KV-event subscribers ============================================================================================
# The subscriber side of KV events (``kvlab.blocks.events``): subscriptions, and the JSONL writer's target.
#
# A ``Subscription`` is one subscriber: a callback, or (without one) a buffer to iterate. The publisher hands it
# each event with ``receive``; a callback that raises is dropped there, so its failure stays its own (see
# "Delivery" in ``kvlab.blocks.events``).

class Subscription:
    """One subscriber of a ``KVEventPublisher``. Without a callback it buffers: iterating yields the events
    published since the last iteration, then stops (nothing blocks: the manager runs in the caller's thread).
    ``closed`` tells whether it still receives events; ``error`` holds the exception that dropped it, if any."""

    def __init__(self, subscriptions: list, callback: Optional[Callable], on_close: Optional[Callable] = None):
        self._subscriptions, self._on_close = subscriptions, on_close
        self._buffer: deque = deque()
        self.callback = self._buffer.append if callback is None else callback
        self.closed = False
        self.error: Optional[BaseException] = None

    def receive(self, event) -> None:
        if self.closed:  # closed by an earlier subscriber's callback during this delivery
            return
        try:
            self.callback(event)
        except Exception as error:  # noqa: BLE001 - a subscriber's failure must not reach the manager
            self.error = error
            self.close()
            warnings.warn(KVEventSubscriberWarning(
                f"KV-event subscriber {self.callback!r} raised {type(error).__name__}: {error} on "
                f"{type(event).__name__}; it was dropped (subscription.error holds the exception) and every "
                "other subscriber still gets every event. Subscribe again to resume."), stacklevel=2)

    def __iter__(self):
        while self._buffer:
            yield self._buffer.popleft()

    def close(self) -> None:
        """Stop receiving events (idempotent); a JSONL path opened by ``write_jsonl`` is closed."""
        if self.closed:
            return
        self.closed = True
        self._subscriptions.remove(self)
        if self._on_close is not None:
            self._on_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def jsonl_writer(target, encode: Callable[[object], dict]) -> tuple[Callable, Optional[Callable]]:
    """``(write(event), on_close)`` for ``write_jsonl(target)``: ``target`` is a path (str or os.PathLike,
    opened for writing now; ``on_close`` closes it) or a text file open for writing (left open, ``on_close``
    None). Raises InvalidArgumentError, opening nothing, for anything else."""
    if hasattr(target, "write"):
        _check_text_file(target)
        file, on_close = target, None
    else:
        file = _open_path(target)
        on_close = file.close
    return (lambda event: file.write(json.dumps(encode(event)) + "\n")), on_close


def _check_text_file(file) -> None:
    name = getattr(file, "name", None) or type(file).__name__
    if getattr(file, "closed", False):
        raise InvalidArgumentError(f"write_jsonl: the file {name!r} is closed; pass a text file open for writing")
    if isinstance(file, (io.RawIOBase, io.BufferedIOBase)):
        raise InvalidArgumentError(f"write_jsonl: the file {name!r} is open in binary mode; pass a text file "
                                   "(open(path, 'w')) or a path")
    try:  # an empty write proves the file takes str now (a read-only text file raises here)
        file.write("")
    except (OSError, ValueError, TypeError) as error:
        raise InvalidArgumentError(f"write_jsonl: the file {name!r} cannot be written as text ({error}); pass a text "
                                   "file open for writing or a path") from None


def _open_path(target):
    # An int would be taken by open() as an OS file descriptor (and closed with the subscription): refused.
    if not isinstance(target, (str, os.PathLike)) or isinstance(os.fspath(target), bytes):
        raise InvalidArgumentError(f"write_jsonl takes a path (str or os.PathLike) or a text file open for "
                                   f"writing, got {type(target).__name__} {target!r}")
    path = os.fspath(target)
    if not path:
        raise InvalidArgumentError("write_jsonl: the path is empty; name a file to write")
    if os.path.isdir(path):
        raise InvalidArgumentError(f"write_jsonl: {path!r} is a directory; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidArgumentError(f"write_jsonl: the folder {folder!r} of {path!r} does not exist")
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as error:
        raise InvalidArgumentError(f"write_jsonl cannot open {path!r} for writing: "
                                   f"{error.strerror or error}") from None


# ==== vLLM's KV events ================================================================================================
# KV cache events: what enters and leaves a manager's prefix cache, in vLLM's event schema.
#
# A router that places requests on many replicas cannot read their pools; vLLM V1 workers publish what they
# cache instead (``vllm/distributed/kv_events.py``), and NVIDIA Dynamo, llm-d and the AIBrix gateway route on
# those events. ``BlockManager(..., kv_events=True)`` and ``HybridBlockManager(..., kv_events=True)`` publish
# the same three kinds:
#
#     BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
#                 group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)
#         a run of consecutive full blocks became hittable (``parent_block_hash``: the block before the run,
#         None at a prompt's start; ``token_ids``: the run's tokens, block after block)
#     BlockRemoved(block_hashes, medium, group_idx)   blocks stopped being hittable (evicted: reused for new content)
#     AllBlocksCleared()                   ``reset_prefix_cache`` forgot every prefix (of every group)
#
# Field names and meanings are vLLM's. kvlab names adapters by key, not by id, so ``lora_id`` and ``lora_name``
# are None; ``extra_keys`` (one entry per block, the non-token inputs of its hash) holds each block's encoded
# salt, adapter and keys (``kvlab.blocks.sequence``) in hex, None for a block without, and is None when no
# block of the run has any.
# vLLM's hybrid-allocator fields: ``group_idx`` is the KV cache group the blocks belong to (the index into the
# hybrid manager's ``groups``), on both BlockStored and BlockRemoved; a store also describes its group with
# ``kv_cache_spec_kind`` (``"full_attention"`` or ``"sliding_window"``, vLLM's KVCacheSpecKind values) and
# ``kv_cache_spec_sliding_window`` (the window in tokens, None for full attention), so a consumer learns the
# groups from the stream. A block's hash is the same in every group (vLLM's events carry the plain block hash
# and ``group_idx``; its pool keys blocks by hash and group, ``BlockHashWithGroupId``), so the same prompt
# stores the same hashes once per group. A ``HybridBlockManager`` fills all three; a single-group
# ``BlockManager`` leaves them None and its events encode without them (vLLM's structs omit fields at their
# None default), as before.
# ``medium`` (vLLM's field) says which tier: ``"GPU"`` for the pool's prefix cache, ``"CPU"`` for the offload tier
# (``BlockManager(num_offload_blocks=N)``, kvlab.blocks.tiers), whose stores name no parent (as vLLM's
# offloading connector's) and always carry one block. The swap space holds swapped sequences, never events.
#
# Events are exact: applying them in order to a set of hashes (``CachedHashes``) gives, after every manager
# call, the set of hashes a prefix lookup can hit, per group for a hybrid manager (each group is its own
# namespace of the prefix index: a lookup in one group never hits another's). A duplicate of a block already
# cached (kvlab keeps one block per hash and group) is not stored twice, so a ``BlockRemoved`` always removes
# a hash that was stored in its group.
#
# Subscribers: ``kv_events.subscribe(callback)`` calls ``callback(event)`` for every event;
# ``kv_events.subscribe()`` returns a subscription to iterate (each event once, in order);
# ``kv_events.write_jsonl(path_or_text_file)`` writes one JSON object per line, tagged ``"type"`` as msgspec
# encodes vLLM's tagged structs (the target is checked, and a path opened, when it is called). Each returns a
# ``Subscription``; ``close()`` (or a ``with`` block) ends it.
#
# Delivery (why subscribers cannot hurt the manager). vLLM's workers publish events from a queue, after the
# scheduler's state change, so a slow or broken consumer never touches the scheduler. kvlab does the same in
# one thread: during a manager call the events only go into a queue (a hybrid manager's groups share one
# queue, delivered by the hybrid manager alone); when the outermost public call has finished its whole state
# change (and released the manager's lock), the queue is delivered, each event to every subscriber in
# subscription order, then the next event. So a subscriber always sees a consistent
# manager, may call the manager itself (its call's events are delivered after the current ones), and may
# close itself or another subscription mid-delivery without anyone else missing an event.
#
# A subscriber that raises is **dropped**: it is closed, its exception is kept in ``subscription.error``,
# and a ``KVEventSubscriberWarning`` names it. Every other subscriber still gets that event and all later
# ones, and the manager call that produced it returns normally (its change is done and consistent; raising
# would tell the caller it failed). Dropping, not skipping one event, because a consumer that missed an event
# holds a wrong index from then on: a router must re-subscribe and rebuild, as a vLLM consumer that lost
# its ZMQ stream replays it. ``write_jsonl`` to a file whose write fails later (a full disk) is dropped the
# same way.

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
    (kvlab.blocks.events): the sink's ``stored``, ``evicted`` and ``cleared`` reports are queued as
    vLLM's events (with no subscriber they return at once), and the manager calls ``deliver()`` when its
    outermost public call has finished (``kvlab.blocks.manager``).

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
                # A keyed block's bytes are its tokens then its keys' encoding (kvlab.blocks.sequence).
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


# ==== residency metrics ===============================================================================================
# Residency metrics of cached blocks, sampled, as vLLM V1's ``KVCacheMetricsCollector``
# (``vllm/v1/core/kv_cache_metrics.py``).
#
# ``BlockManager(..., kv_cache_metrics=KVCacheMetricsCollector(sample_rate=0.01))`` (vLLM: ``--kv-cache-metrics``
# with ``--kv-cache-metrics-sample 0.01``). The collector is one more consumer of the manager's event sink
# (kvlab.blocks.events), so a manager without one pays nothing: its sink stays None. For each block that
# enters a cache, a ``sample_rate`` share of them (a seeded draw: a replay is reproducible), it keeps the time it
# entered, its last access and its last four accesses (vLLM's bounded history); when the block is evicted it
# records one ``ResidencyEvent``:
#
#     lifetime_s     eviction time - entry time
#     idle_s         eviction time - last access (the entry time if never hit): idle before eviction
#     reuse_gaps_s   the gaps between its successive recorded accesses (none with fewer than two: as in vLLM,
#                    the entry itself is not an access, so a block hit once has no gap)
#
# vLLM samples at allocation; kvlab at sealing (the moment the block becomes cached, the same step for a prompt
# block), since only a cached block can be hit or evicted. Both tiers are covered, each event carrying its
# ``medium`` (vLLM's KV-event field): "GPU" (entry: sealed or promoted into the pool; access: a prefix hit;
# eviction: reused for new content) and "CPU" (the offload tier: entry at offload, access at promotion, eviction
# when the tier's policy drops it). Blocks still resident at the end are not events: only evictions are.
#
# ``clock`` gives the time in seconds (``time.monotonic`` by default; a replay passes its trace's arrival clock).
# ``summary(medium)`` turns the events into histogram summaries (count, mean, percentiles) per metric.

#: Accesses remembered per sampled block (vLLM's ``deque(maxlen=4)``): bounded, however often a block is hit.
ACCESS_HISTORY = 4
MEDIA = ("GPU", "CPU")
METRICS = ("lifetime_s", "idle_s", "reuse_gap_s")
QUANTILES = (0.5, 0.9, 0.99)


class ResidencyEvent(NamedTuple):
    """One sampled block's eviction (vLLM's ``KVCacheEvictionEvent``), in ``medium`` ("GPU" or "CPU")."""
    medium: str
    lifetime_s: float
    idle_s: float
    reuse_gaps_s: tuple


class KVCacheMetricsCollector(EventSink):
    def __init__(self, sample_rate: float = 0.01, clock=time.monotonic, seed: int = 0):
        self.sample_rate = check_number("sample_rate", sample_rate, 0, 1, min_open=True)
        self.clock = clock
        self._draw = random.Random(seed).random
        # medium -> slot -> [entry time, last access, deque of access times]
        self._tracked = {medium: {} for medium in MEDIA}
        self.events: list[ResidencyEvent] = []

    # ---- the sink's reports ----------------------------------------------------------------------------------
    def sealed(self, blocks):
        self._enter("GPU", blocks)

    def promoted(self, slots, blocks):
        self._access("CPU", slots)
        self._enter("GPU", blocks)

    def looked_up(self, seq_id, hits, misses):
        self._access("GPU", hits)

    def evicted(self, blocks, hashes, contents):
        self._evict("GPU", blocks)

    def offloaded(self, block, slot, block_hash, content):
        self._enter("CPU", (slot,))

    def tier_removed(self, slots, hashes):
        self._evict("CPU", slots)

    def cleared(self):
        self.reset()

    # ---- results ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every tracked block and event (vLLM's ``reset``, on ``reset_prefix_cache``)."""
        for tracked in self._tracked.values():
            tracked.clear()
        self.events = []

    def drain_events(self) -> list[ResidencyEvent]:
        """The events recorded since the last call (vLLM's ``drain_events``)."""
        events, self.events = self.events, []
        return events

    def summary(self, medium: str = "GPU", events=None) -> dict:
        """``{metric_count, metric_mean, metric_p50, metric_p90, metric_p99}`` for each metric of ``METRICS``
        over ``events`` (default: those recorded and not drained) in ``medium``; NaN where there is no sample."""
        events = self.events if events is None else events
        mine = [e for e in events if e.medium == medium]
        values = {"lifetime_s": [e.lifetime_s for e in mine], "idle_s": [e.idle_s for e in mine],
                  "reuse_gap_s": [gap for e in mine for gap in e.reuse_gaps_s]}
        return {key: value for metric in METRICS for key, value in describe(metric, values[metric]).items()}

    # ---- internals ---------------------------------------------------------------------------------------------
    def _enter(self, medium, slots):
        tracked, draw, rate = self._tracked[medium], self._draw, self.sample_rate
        now = None
        for slot in slots:
            if draw() < rate:
                now = self.clock() if now is None else now
                tracked[slot] = [now, now, deque(maxlen=ACCESS_HISTORY)]
            else:
                tracked.pop(slot, None)  # new content in a slot sampled before: its old record is stale

    def _access(self, medium, slots):
        tracked = self._tracked[medium]
        if not tracked:
            return
        now = None
        for slot in slots:
            state = tracked.get(slot)
            if state is not None:
                now = self.clock() if now is None else now
                state[1] = now
                state[2].append(now)

    def _evict(self, medium, slots):
        tracked = self._tracked[medium]
        if not tracked:
            return
        now = None
        for slot in slots:
            state = tracked.pop(slot, None)
            if state is not None:
                now = self.clock() if now is None else now
                entered, last, history = state
                gaps = tuple(b - a for a, b in zip(history, list(history)[1:]))
                self.events.append(ResidencyEvent(medium, now - entered, now - last, gaps))


def describe(metric: str, values) -> dict:
    """Histogram summary of ``values``: ``{metric}_count``, ``_mean`` and ``_p50`` / ``_p90`` / ``_p99``."""
    out = {f"{metric}_count": len(values)}
    array = np.asarray(values, dtype=float)
    out[f"{metric}_mean"] = float(array.mean()) if len(array) else float("nan")
    for q in QUANTILES:
        out[f"{metric}_p{round(q * 100)}"] = float(np.quantile(array, q)) if len(array) else float("nan")
    return out
