"""The prefix cache: chained block hashes (computed once in a sequence's life) and the prefix index of a
tier (verified lookup, seal, evict: which slot holds which sealed content, keyed by hash, checked by content).
"""

from array import array
import hashlib
from itertools import compress
import struct
import sys
from typing import Callable, NamedTuple, Optional

import xxhash

from kvlab.errors import InvalidArgumentError, InvariantViolation


# ==== chained block hashes ============================================================================================
# Chained block hashes: the key under which the prefix cache finds a full block.
#
# A block's hash covers its parent's hash and its own token ids, so equal hashes mean (up to collisions)
# equal prefixes, not merely equal blocks: the same tokens after a different prefix have different K/V and
# must not hit. The default is xxh64 over the block's tokens as little-endian int64 bytes, seeded with the
# parent's hash (the first block's seed is 0). Collisions are harmless for correctness: the pool compares
# the tokens and the parent block before it shares anything (see ``PrefixIndex.lookup``).
#
# A salted or keyed sequence's blocks (``kvlab.blocks.sequence``) are their token bytes followed by the
# keys' encoding, and xxh64 hashes those same bytes: another tenant's lookup misses at the hash map (barring a
# 64-bit collision, which the comparison then catches). A custom ``hash_fn`` sees only the tokens (it is for
# experiments with weak hashes): the keys still keep blocks apart, since the pool compares the bytes with the
# keys, but blocks of different salts may then compete for one hash and shadow each other's hits.

#: ``hash_fn(parent_hash_or_None, token_ids_tuple) -> int``, to replace the default in experiments/tests.
HashFn = Callable[[Optional[int], tuple], int]



class HashChain:
    """A ``hash_fn`` whose chaining is someone else's (the course's capstone plugs in a learner's
    ``block_hashes(tokens, block_size, hash_fn)``, kvlab.puzzles.block_hashes): ``block_hashes`` below hands
    ``chain`` a run of full blocks and their parent's hash, and ``chain`` returns one hash per block."""

    def __init__(self, chain, hash_fn: HashFn):
        self._chain, self._hash_fn = chain, hash_fn

    def __call__(self, parent: Optional[int], block: tuple) -> int:
        return self._hash_fn(parent, block)

    def chain(self, tokens: list[int], block_size: int, parent: Optional[int]) -> list[int]:
        """The hashes of ``tokens``' blocks (all full) chained after ``parent``: the chain's first block comes
        with parent None, which stands for ``parent`` here (the run may start mid-sequence)."""
        return self._chain(tokens, block_size,
                           lambda p, block: self._hash_fn(parent if p is None else p, tuple(block)))


if sys.byteorder != "little":
    raise ImportError("kvlab hashes tokens as native int64 bytes, which must be little-endian")


def block_contents(tokens: array, block_size: int, start: int, stop: int, keys: Optional[dict]) -> list[bytes]:
    """Bytes of full blocks ``start..stop-1`` of ``tokens``; ``keys`` (``seq.key_bytes``) extends keyed blocks.
    One copy, then one ``struct`` unpack cuts it in C (compiled per call: a cached format would keep a long
    prompt's codes alive), a third of the time of a Python loop of slices; hashing is a sixth of a replay."""
    raw = memoryview(tokens)[start * block_size:stop * block_size].tobytes()
    contents = list(struct.Struct(f"{8 * block_size}s" * (stop - start)).unpack(raw))
    if keys:
        for i, suffix in keys.items():
            if start <= i < stop:
                contents[i - start] += suffix
    return contents


def block_hashes(tokens: array, block_size: int, start: int, stop: int, parent: Optional[int],
                 hash_fn: Optional[HashFn] = None, keys: Optional[dict] = None) -> tuple[list[int], list[bytes]]:
    """Hashes and bytes of full blocks ``start..stop-1`` of ``tokens``, chained from ``parent`` (the hash of
    block ``start - 1``, or None for the first block); ``keys`` (``seq.key_bytes``) extends keyed blocks."""
    contents = block_contents(tokens, block_size, start, stop, keys)
    if hash_fn is None:
        xxh64, parent, hashes = xxhash.xxh64_intdigest, parent or 0, []
        for content in contents:  # a loop, not a comprehension: no frame of its own
            parent = xxh64(content, parent)
            hashes.append(parent)
        return hashes, contents
    if isinstance(hash_fn, HashChain):
        return hash_fn.chain(tokens[start * block_size:stop * block_size].tolist(), block_size, parent), contents
    hashes = []
    for i in range(start, stop):
        try:
            parent = hash_fn(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
        except Exception as e:
            raise InvalidArgumentError(f"hash_fn raised {type(e).__name__}: {e}") from e
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise InvalidArgumentError(f"hash_fn must return an int, got {type(parent).__name__}")
        hashes.append(parent)
    return hashes, contents


class BlockHashes:
    """A sequence's leading full blocks' hashes under one block size, ``hash_fn`` and keys (vLLM V1's
    ``request.block_hashes``): computed once for the sequence's whole life (a sequence preempted by
    recompute is not hashed again) and extended as blocks fill. Tokens only change by appending, or by
    ``fork`` replacing them, which hands the child a copy of these (``copy_tokens``).

    The blocks' bytes (``contents``, for the verified lookup and for sealing) are kept only while some of
    them still wait to be sealed: a scheduler calls ``can_allocate`` then ``allocate``, and a chunked prompt
    seals its blocks over several steps. Once all are sealed they are dropped while still warm in the CPU
    cache (kept cold, they cost 5% of a replay in cache misses) and re-sliced from the tokens if needed."""
    __slots__ = ("block_size", "hash_fn", "keys", "hashes", "contents")

    def __init__(self, block_size: int, hash_fn: Optional[HashFn], keys: Optional[dict]):
        self.block_size, self.hash_fn, self.keys = block_size, hash_fn, keys
        self.hashes: list[int] = []
        self.contents: Optional[list[bytes]] = []  # bytes of the blocks of ``hashes``, or None (dropped)

    def copy(self) -> "BlockHashes":
        twin = BlockHashes(self.block_size, self.hash_fn, self.keys)
        twin.hashes, twin.contents = list(self.hashes), None  # its bytes are sliced again if needed
        return twin

    def extend(self, tokens: array, stop: int) -> None:
        """Hash blocks ``len(hashes)..stop-1`` (their bytes too, while the others' are kept)."""
        start = len(self.hashes)
        if stop > start:
            hashes, contents = block_hashes(tokens, self.block_size, start, stop,
                                            self.hashes[-1] if start else None, self.hash_fn, self.keys)
            self.hashes += hashes
            if self.contents is not None:
                self.contents += contents


def hashes_of(seq, block_size: int, hash_fn: Optional[HashFn]) -> BlockHashes:
    """``seq``'s block hashes for this block size, ``hash_fn`` and its keys: the cached ones, or new (empty)
    ones where they were computed under others (the sequence moved to another manager)."""
    entry, keys = seq.block_hashes, seq.key_bytes
    if entry is None or entry.block_size != block_size or entry.hash_fn is not hash_fn or entry.keys is not keys:
        entry = seq.block_hashes = BlockHashes(block_size, hash_fn, keys)
    return entry


def prompt_blocks(seq, block_size: int, hash_fn: Optional[HashFn]) -> tuple[list[int], list[bytes]]:
    """Hashes and bytes of all of ``seq``'s full blocks, hashing only those not hashed before."""
    entry, tokens, keys = hashes_of(seq, block_size, hash_fn), seq.token_array, seq.key_bytes
    start, stop = len(entry.hashes), len(tokens) // block_size
    if entry.contents is None:  # dropped once every block was sealed: sliced again
        entry.contents = block_contents(tokens, block_size, 0, start, keys)
    if stop > start:
        hashes, contents = block_hashes(tokens, block_size, start, stop, entry.hashes[-1] if start else None,
                                        hash_fn, keys)
        entry.hashes += hashes
        entry.contents += contents
    return entry.hashes, entry.contents  # read them now: later blocks extend these lists


def hashes_to_seal(seq, start: int, stop: int, block_size: int, hash_fn: Optional[HashFn]) -> tuple[list, list]:
    """Hashes and bytes of blocks ``start..stop-1``, which a step is about to seal: hashed only if new."""
    entry, tokens = hashes_of(seq, block_size, hash_fn), seq.token_array
    entry.extend(tokens, stop)
    contents = entry.contents
    if contents is None or len(contents) < stop:
        return entry.hashes[start:stop], block_contents(tokens, block_size, start, stop, entry.keys)
    return entry.hashes[start:stop], contents[start:stop]


def sealed_through(seq, num_sealed: int) -> None:
    """``seq``'s first ``num_sealed`` blocks are sealed: drop the bytes once none of them waits any more."""
    entry = seq.block_hashes
    if entry is not None and entry.contents is not None and num_sealed >= len(entry.contents):
        entry.contents = None


# ==== the prefix index ================================================================================================
# The prefix index: which slot of a tier holds which sealed content, looked up by hash and verified by content.
#
# A *slot* is a block of one tier (a GPU block of ``BlockPool``, or a CPU slot of an offload tier); the index
# knows nothing about reference counts or free lists, only what each slot holds. A sealed slot records a
# content id: a unique number for "these bytes (its tokens, then its keys: a tenant's salt, an adapter, an
# image; see ``kvlab.blocks.sequence``) after that exact prefix", the content id of its parent (the block it
# was computed after; ``ROOT`` for a sequence's first block), and the bytes themselves. A slot is *cached*
# (hittable) when the hash map points at it; at most one slot per hash is.
#
# KV cache groups (a hybrid model's layer kinds: kvlab.blocks.manager) are namespaces of the index, as
# vLLM V1's ``BlockHashWithGroupId`` keys its ``BlockPool``: one hash map per group, and each sealed slot records
# its group. The same tokens have the same hash (and bytes) in every group, but a lookup in group g sees only
# group g's map, so no group is ever handed another's block: the layers differ, and so does their K/V. A
# single-group manager has one namespace, ``cached``.
#
# Why content ids: a lookup shares slot c for logical block i only if c holds the same bytes AND c's parent
# holds exactly the content the lookup matched for block i - 1. Comparing content ids (not slot ids, which are
# reused) makes that check O(1) and immune to hash collisions at this block or any earlier one: a weak hash only
# costs hits, never correctness. Content ids come from one ``ContentIds`` counter shared by every tier's index,
# so one id stands for one (parent, bytes) in all of them and an entry moved between tiers keeps its id (the
# chain it extends stays verifiable there).
#
# Per-slot state lives in parallel lists indexed by slot (cheaper than an object per slot: a tuple per block
# would be a GC-tracked allocation per block, ~13% of a replay).

NO_CONTENT = -1  # slot holds nothing sealed
ROOT = 0         # the "parent content" of a sequence's first block


class ContentIds:
    """The source of content ids, shared by the indexes of every tier of one manager."""
    interned = None  # InternedContentIds' registry; None: a new id per sealed block

    def __init__(self):
        self.next = ROOT + 1


class InternedContentIds(ContentIds):
    """Content ids shared by several managers (a fleet's replicas) and the tier they share
    (kvlab.blocks.tiers.make_shared_tier): one id per (parent id, bytes) whichever manager sealed it, so
    a chain one replica computed continues in the entries another offloaded, and the verification above holds
    across them (one id stands for one parent and one run of bytes everywhere). The registry keeps the bytes'
    SHA-256 digest, not the bytes (32 bytes per distinct block ever sealed): two contents share an id only if
    their digests collide."""

    def __init__(self):
        super().__init__()
        self.interned: dict[tuple[int, bytes], int] = {}

    def intern(self, parent: int, content: bytes) -> int:
        key = (parent, hashlib.sha256(content).digest())
        cid = self.interned.get(key)
        if cid is None:
            cid = self.interned[key] = self.next
            self.next += 1
        return cid


class Evicted(NamedTuple):
    """What an eviction dropped from the index, as it was just before: slot ``slots[i]`` held ``contents[i]``
    (its tokens as int64 bytes, then its keys' encoding) under hash ``hashes[i]``, with content id
    ``content_ids[i]`` chained after ``parents[i]``. Aligned lists, not a record per slot (see above)."""
    slots: list
    hashes: list
    contents: list
    content_ids: list
    parents: list


class PrefixIndex:
    def __init__(self, num_slots: int, ids: Optional[ContentIds] = None, name: str = "GPU block",
                 num_groups: int = 1):
        self.num_slots, self.num_groups = num_slots, num_groups
        self.ids = ids if ids is not None else ContentIds()
        self.name = name  # how error messages call a slot
        self.generation = 0
        self.forget_all()

    def forget_all(self) -> None:
        """Every slot stops holding sealed content."""
        # Bumped whenever a hittable slot stops being one: a lookup's hits are still valid while it is unchanged.
        self.generation += 1
        n = self.num_slots
        self.hash: list[Optional[int]] = [None] * n
        self.content = [NO_CONTENT] * n
        self.parent_content = [NO_CONTENT] * n
        self.block_bytes: list[Optional[bytes]] = [None] * n
        # Per group: hash -> the one registered slot with that hash in that group. ``cached`` is group 0's.
        self.namespaces: list[dict[int, int]] = [{} for _ in range(self.num_groups)]
        self.cached = self.namespaces[0]
        self.group = [0] * n  # the group a sealed slot's content belongs to
        # registered[s] == (namespaces[group[s]].get(hash of s) == s), kept for speed
        self.registered = [False] * n
        # warm[s]: a lookup can hit slot s, so a free s is filed as cached with the eviction policy
        self.warm = self.registered

    @property
    def num_cached(self) -> int:
        """Slots a lookup of some group can hit now."""
        return sum(map(len, self.namespaces))

    def is_cached(self, slot: int) -> bool:
        return self.registered[slot]

    def block_hash(self, slot: int) -> Optional[int]:
        return self.hash[slot]

    def content_id(self, slot: int) -> int:
        return self.content[slot]

    def lookup(self, hashes: list[int], contents: list[bytes], limit: int, parent: int = ROOT,
               group: int = 0) -> list[int]:
        """The cached slots of ``group`` matching the first full blocks of a prompt (chained after content
        ``parent``), in order, stopping at the first miss (at most ``limit``). Pure: changes nothing."""
        hits: list[int] = []
        cached, block_bytes, parent_content, content = (self.namespaces[group], self.block_bytes,
                                                        self.parent_content, self.content)
        for i in range(min(limit, len(hashes))):
            slot = cached.get(hashes[i])
            if slot is None or parent_content[slot] != parent or block_bytes[slot] != contents[i]:
                break
            hits.append(slot)
            parent = content[slot]
        return hits

    def seal(self, slots, hashes, contents, parent: int, group: int = 0) -> int:
        """Record that each of ``slots`` is full with ``contents[i]`` (hash ``hashes[i]``) in ``group``, chained
        after the prefix whose content id is ``parent``, and register each unless another slot of the group
        already holds its hash (then only the first stays hittable). Returns the last slot's content id, the
        next slot's ``parent``. The slots that got a new content id are those with ``content[s] >=`` the ids'
        ``next`` before."""
        if self.num_groups > 1:
            group_of = self.group
            for slot in slots:
                group_of[slot] = group
        if self.ids.interned is not None:
            return self._seal_interned(slots, hashes, contents, parent, group)
        setdefault, registered, block_hash = self.namespaces[group].setdefault, self.registered, self.hash
        content_id, parent_content, block_bytes = self.content, self.parent_content, self.block_bytes
        cid = self.ids.next
        for slot, h, content in zip(slots, hashes, contents):
            block_hash[slot] = h
            twin = setdefault(h, slot)
            if twin == slot:
                registered[slot] = True
            elif parent_content[twin] == parent and block_bytes[twin] == content:
                # The same prefix is already cached in another slot: this one is an unregistered duplicate
                # with the same content id, so blocks sealed after it still chain to the cached prefix.
                content_id[slot] = parent = content_id[twin]
                parent_content[slot], block_bytes[slot] = parent_content[twin], content
                continue
            content_id[slot], parent_content[slot], block_bytes[slot] = cid, parent, content
            parent = cid
            cid += 1
        self.ids.next = cid
        return parent

    def _seal_interned(self, slots, hashes, contents, parent: int, group: int) -> int:
        """``seal`` with interned ids: each slot's id is the one its (parent, bytes) has everywhere."""
        intern, setdefault = self.ids.intern, self.namespaces[group].setdefault
        for slot, h, content in zip(slots, hashes, contents):
            self.hash[slot] = h
            self.registered[slot] = setdefault(h, slot) == slot  # else a twin holds the hash (see seal)
            cid = intern(parent, content)
            self.content[slot], self.parent_content[slot], self.block_bytes[slot] = cid, parent, content
            parent = cid
        return parent

    def put(self, slots, hashes, contents, content_ids, parents) -> None:
        """Record entries that keep the content ids they had in another tier (a block moved between tiers
        holds the same bytes after the same prefix); each is registered unless another slot holds its hash.
        Group 0's: only a single-group manager has a second tier."""
        setdefault, registered = self.cached.setdefault, self.registered
        for slot, h, content, cid, parent in zip(slots, hashes, contents, content_ids, parents):
            self.hash[slot], self.content[slot] = h, cid
            self.parent_content[slot], self.block_bytes[slot] = parent, content
            registered[slot] = setdefault(h, slot) == slot

    def evict(self, slots, num_resealed: int = 0) -> Optional[Evicted]:
        """``slots`` are reused for new content: the cached ones stop being hittable, and all but the first
        ``num_resealed`` (about to be sealed again, which overwrites them) hold no sealed content now. Returns
        what the cached ones held, or None if none was cached."""
        registered = self.registered
        dropped = list(compress(slots, map(registered.__getitem__, slots)))
        evicted = None
        if dropped:
            self.generation += 1
            block_hash, block_bytes = self.hash, self.block_bytes
            content, parent_content = self.content, self.parent_content
            hashes = []
            namespaces, group_of = self.namespaces, self.group
            for slot in dropped:
                registered[slot] = False
                h = block_hash[slot]
                del namespaces[group_of[slot]][h]
                hashes.append(h)
            evicted = Evicted(dropped, hashes, [block_bytes[s] for s in dropped], [content[s] for s in dropped],
                              [parent_content[s] for s in dropped])
        block_hash, content = self.hash, self.content
        for slot in slots[num_resealed:]:
            block_hash[slot] = None
            content[slot] = NO_CONTENT
        return evicted

    def check(self) -> None:
        """Raise InvariantViolation unless the hash map, the registered flags and the content ids agree.
        O(number of slots)."""
        for group, cached in enumerate(self.namespaces):
            for h, slot in cached.items():
                if self.hash[slot] != h or self.content[slot] <= ROOT or self.group[slot] != group:
                    _fail(f"prefix cache maps hash {h} of group {group} to block {slot}, which does not hold "
                          "that sealed content in that group")
        if sum(self.registered) != self.num_cached or any(
                self.registered[s] != (self.namespaces[self.group[s]].get(self.hash[s]) == s)
                for s in range(self.num_slots)):
            _fail("a block's registered flag disagrees with the prefix cache map")
        # A lookup trusts a content id to stand for one parent and one run of bytes (tokens and keys): were it
        # to stand for two, a hit could hand out K/V of other tokens, or of another tenant.
        sealed = {}
        for s in range(self.num_slots):
            cid, what = self.content[s], (self.parent_content[s], self.block_bytes[s])
            if cid > ROOT and sealed.setdefault(cid, what) != what:
                _fail(f"{self.name} {s} has content id {cid} but not the parent and bytes of its other blocks")


class _WarmFlags:
    """``warm[s]`` of a ``UnitPrefixIndex``: slot s is registered or holds partial entries."""
    __slots__ = ("registered", "partial_of")

    def __init__(self, registered, partial_of):
        self.registered, self.partial_of = registered, partial_of

    def __getitem__(self, slot: int) -> bool:
        return self.registered[slot] or slot in self.partial_of


def _fail(message: str):
    raise InvariantViolation(message)


# ==== partial-block entries (prefix_match_unit) =======================================================================
# vLLM's ``hash_block_size`` (RFC #45702's ``prefix_match_unit``): the cache also matches a prompt at a unit finer
# than the block. A block whose first k units (k >= 1, fewer than a block's) a sequence's prompt wrote is findable
# by those units' chain: seeded with the content id of the block before it (so the whole prefix is named exactly,
# as the full-block chain names it) and its keys' bytes, then one xxh64 per unit. A hit is verified by content, as
# a full hit is: the entry's parent, keys and token bytes must equal the prompt's. A partial hit is never shared
# in place (the block's later positions belong to its owner): the hitting sequence takes a new block and copies
# the first k units into it (copy-on-write at admission, kvlab.blocks.manager).

class UnitPrefixIndex(PrefixIndex):
    """A ``PrefixIndex`` that also finds slots by their first k units of ``unit`` tokens (``add_partial``,
    ``find_partial``); a slot's partial entries go when the slot is reused for new content (``evict``).
    ``block_sizes``: each group's tokens per block (groups may differ)."""

    def __init__(self, num_slots: int, unit: int, block_sizes: tuple, ids: Optional[ContentIds] = None,
                 num_groups: int = 1):
        self.unit, self.units_per_block = unit, [size // unit for size in block_sizes]
        super().__init__(num_slots, ids, num_groups=num_groups)

    def forget_all(self) -> None:
        super().forget_all()
        self.partial: list[dict[int, int]] = [{} for _ in range(self.num_groups)]  # per group: unit chain -> slot
        # slot -> (group, parent content id, keys' bytes, its first units' token bytes, the chain hashes it owns)
        self.partial_of: dict[int, tuple] = {}
        self.warm = _WarmFlags(self.registered, self.partial_of)

    def unit_chain(self, parent: int, suffix: bytes, token_bytes: bytes) -> list[int]:
        """The chained hash of the first 1, 2, ... whole units of ``token_bytes``, after content ``parent``."""
        step, xxh64 = 8 * self.unit, xxhash.xxh64_intdigest
        h, chain = xxh64(suffix, parent), []
        for start in range(0, len(token_bytes) - step + 1, step):
            h = xxh64(token_bytes[start:start + step], h)
            chain.append(h)
        return chain

    def add_partial(self, slot: int, group: int, parent: int, suffix: bytes, token_bytes: bytes) -> None:
        """``slot`` holds ``token_bytes`` (whole units) after content ``parent`` with keys ``suffix``: make it
        findable by each of its first 1 .. units_per_block[group] - 1 units (a longer entry replaces a shorter
        one)."""
        token_bytes = token_bytes[:8 * self.unit * (self.units_per_block[group] - 1)]
        old = self.partial_of.get(slot)
        if old is not None:
            if len(old[3]) >= len(token_bytes):
                return
            self._drop_partial(slot)
        setdefault, owned = self.partial[group].setdefault, []
        for h in self.unit_chain(parent, suffix, token_bytes):
            if setdefault(h, slot) == slot:  # else another slot holds these units: it stays the one found
                owned.append(h)
        self.partial_of[slot] = (group, parent, suffix, token_bytes, owned)

    def find_partial(self, group: int, parent: int, suffix: bytes, token_bytes: bytes, chain: list[int],
                     max_units: int) -> tuple[int, Optional[int]]:
        """(k, slot): the most units k <= ``max_units`` of ``token_bytes`` (chain hashes ``chain``) a slot of
        ``group`` holds after content ``parent`` with keys ``suffix``, verified by content; (0, None) if none.
        Pure."""
        step, namespace = 8 * self.unit, self.partial[group]
        for k in range(max_units, 0, -1):
            slot = namespace.get(chain[k - 1])
            if slot is not None and self.holds(slot, group, parent, suffix, token_bytes[:k * step]):
                return k, slot
        return 0, None

    def holds(self, slot: int, group: int, parent: int, suffix: bytes, token_bytes: bytes) -> bool:
        """Whether ``slot`` has a partial entry of ``group`` whose first tokens are ``token_bytes`` (whole units)
        after content ``parent`` with keys ``suffix``: the content check of a partial hit."""
        entry = self.partial_of.get(slot)
        return entry is not None and entry[0] == group and entry[1] == parent and entry[2] == suffix \
            and len(token_bytes) <= len(entry[3]) and entry[3].startswith(token_bytes)

    def evict(self, slots, num_resealed: int = 0) -> Optional[Evicted]:
        partial_of = self.partial_of
        for slot in slots:
            if slot in partial_of:
                self._drop_partial(slot)
        return super().evict(slots, num_resealed)


    def _drop_partial(self, slot: int) -> None:
        group, _, _, _, owned = self.partial_of.pop(slot)
        namespace = self.partial[group]
        for h in owned:
            del namespace[h]
        self.generation += 1  # a lookup's partial hit on this slot is stale now

    def check(self) -> None:
        super().check()
        owners = {}
        for slot, (group, parent, suffix, token_bytes, owned) in self.partial_of.items():
            if len(token_bytes) % (8 * self.unit) or \
                    len(token_bytes) >= 8 * self.unit * self.units_per_block[group]:
                _fail(f"{self.name} {slot}'s partial entry holds {len(token_bytes) // 8} tokens, not fewer than a "
                      f"block's worth of whole {self.unit}-token units")
            if not set(owned) <= set(self.unit_chain(parent, suffix, token_bytes)):
                _fail(f"{self.name} {slot} owns partial entries that are not the chain of its units")
            owners.update(((group, h), slot) for h in owned)
        held = {(group, h): slot for group, namespace in enumerate(self.partial) for h, slot in namespace.items()}
        if held != owners:
            _fail("the partial-block map disagrees with the entries its slots own")
