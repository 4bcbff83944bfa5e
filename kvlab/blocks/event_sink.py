"""The one sink of what the block manager does: the manager and its pool report each change to it, and its
consumers turn the reports into their own records.

Two consumers ship with kvlab: ``EventLog``, the teaching ``Event`` records of ``record_events=True``
(timelines, notebooks), and ``KVEventPublisher`` (kvlab.blocks.kv_events), vLLM's KV cache events of
``kv_events=True`` for routers. A second cache tier would be a third: ``evicted`` hands it every cached
block's hash and content as the pool drops it. ``make_sink`` combines the consumers that are on; with none, the
manager holds None, and each report site costs one ``is None`` check.

Timing: every report is made under the manager's lock, right after the part of the state change it
describes, so a consumer can read the pool as it is then (a KV ``stored`` needs to know which blocks the
prefix cache registered). Consumers only record; nothing outside kvlab runs during a call: the KV events
reach their subscribers after the outermost call finished (kvlab.blocks.locking).
"""

from typing import Optional

from kvlab.blocks.records import Event


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
        tokens as int64 bytes, then its keys' encoding: kvlab.blocks.block_keys) under hash ``hashes[i]``.
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
    """One KV cache group's view of a hybrid manager's sink (kvlab.blocks.hybrid_manager): each group's
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
