"""Chained block hashes: the key under which the prefix cache finds a full block.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean (up to collisions)
equal prefixes, not merely equal blocks: the same tokens after a different prefix have different K/V and
must not hit. The default is xxh64 over the block's tokens as little-endian int64 bytes, seeded with the
parent's hash (the first block's seed is 0). Collisions are harmless for correctness: the pool compares
the tokens and the parent block before it shares anything (see ``PrefixIndex.lookup``).

A salted or keyed sequence's blocks (``kvlab.blocks.block_keys``) are their token bytes followed by the
keys' encoding, and xxh64 hashes those same bytes: another tenant's lookup misses at the hash map (barring a
64-bit collision, which the comparison then catches). A custom ``hash_fn`` sees only the tokens (it is for
experiments with weak hashes): the keys still keep blocks apart, since the pool compares the bytes with the
keys, but blocks of different salts may then compete for one hash and shadow each other's hits.
"""

import struct
import sys
from array import array
from typing import Callable, Optional

import xxhash

from kvlab.blocks.sequence import block_hashes_box, key_bytes, token_buffer
from kvlab.errors import InvalidArgumentError

#: ``hash_fn(parent_hash_or_None, token_ids_tuple) -> int``, to replace the default in experiments/tests.
HashFn = Callable[[Optional[int], tuple], int]

if sys.byteorder != "little":
    raise ImportError("kvlab hashes tokens as native int64 bytes, which must be little-endian")


def _split_blocks(raw: bytes, width: int) -> list[bytes]:
    """``raw`` cut into ``width``-byte pieces, in C: one ``struct`` unpack (compiled per call: a cached
    format would keep a long prompt's codes alive) takes a third of the time of a Python loop of slices or
    a regex ``findall``, and hashing is a sixth of a replay's time."""
    return list(struct.Struct(f"{width}s" * (len(raw) // width)).unpack(raw))


def block_contents(tokens: array, block_size: int, start: int, stop: int, keys: Optional[dict]) -> list[bytes]:
    """Bytes of full blocks ``start..stop-1`` of ``tokens``; ``keys`` (``key_bytes(seq)``) extends keyed blocks."""
    raw = memoryview(tokens)[start * block_size:stop * block_size].tobytes()  # one copy, then cheap slices
    contents = _split_blocks(raw, 8 * block_size)
    if keys:
        for i, suffix in keys.items():
            if start <= i < stop:
                contents[i - start] += suffix
    return contents


def block_hashes(tokens: array, block_size: int, start: int, stop: int, parent: Optional[int],
                 hash_fn: Optional[HashFn] = None, keys: Optional[dict] = None) -> tuple[list[int], list[bytes]]:
    """Hashes and bytes of full blocks ``start..stop-1`` of ``tokens``, chained from ``parent`` (the hash of
    block ``start - 1``, or None for the first block); ``keys`` (``key_bytes(seq)``) extends keyed blocks."""
    contents = block_contents(tokens, block_size, start, stop, keys)
    if hash_fn is None:
        xxh64, parent = xxhash.xxh64_intdigest, parent or 0
        return [parent := xxh64(content, parent) for content in contents], contents
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
        self.contents: Optional[list[bytes]] = None  # bytes of the blocks of ``hashes``, or None (dropped)

    def copy(self) -> "BlockHashes":
        twin = BlockHashes(self.block_size, self.hash_fn, self.keys)
        twin.hashes = list(self.hashes)
        return twin

    def extend(self, tokens: array, stop: int) -> None:
        """Hash blocks ``len(hashes)..stop-1`` (their bytes too, while the others' are kept)."""
        start = len(self.hashes)
        if stop <= start:
            return
        hashes, contents = block_hashes(tokens, self.block_size, start, stop, self.hashes[-1] if start else None,
                                        self.hash_fn, self.keys)
        if start:
            self.hashes += hashes
            if self.contents is not None:
                self.contents += contents
        else:  # the usual first call: no copy
            self.hashes = hashes
            if self.contents is not None:
                self.contents = contents


def hashes_of(seq, block_size: int, hash_fn: Optional[HashFn]) -> BlockHashes:
    """``seq``'s block hashes for this block size, ``hash_fn`` and its keys: the cached ones, or new (empty)
    ones where they were computed under others (the sequence moved to another manager)."""
    box = block_hashes_box(seq)
    keys, entry = key_bytes(seq), box[0]
    if (entry is None or entry.block_size != block_size or entry.hash_fn is not hash_fn
            or (entry.keys is not keys and entry.keys != keys)):
        entry = box[0] = BlockHashes(block_size, hash_fn, keys)
    return entry


def prompt_blocks(seq, block_size: int, hash_fn: Optional[HashFn]) -> tuple[list[int], list[bytes]]:
    """Hashes and bytes of all of ``seq``'s full blocks, hashing only those not hashed before."""
    entry, tokens = hashes_of(seq, block_size, hash_fn), token_buffer(seq)
    stop = len(tokens) // block_size
    if entry.contents is None:
        entry.contents = block_contents(tokens, block_size, 0, len(entry.hashes), entry.keys) if entry.hashes else []
    entry.extend(tokens, stop)
    return entry.hashes, entry.contents  # read them now: later blocks extend these lists


def hashes_to_seal(seq, start: int, stop: int, block_size: int, hash_fn: Optional[HashFn]) -> tuple[list, list]:
    """Hashes and bytes of blocks ``start..stop-1``, which a step is about to seal: hashed only if new."""
    entry, tokens = hashes_of(seq, block_size, hash_fn), token_buffer(seq)
    entry.extend(tokens, stop)
    contents = entry.contents
    if contents is None or len(contents) < stop:
        return entry.hashes[start:stop], block_contents(tokens, block_size, start, stop, entry.keys)
    return entry.hashes[start:stop], contents[start:stop]


def sealed_through(seq, num_sealed: int) -> None:
    """``seq``'s first ``num_sealed`` blocks are sealed: drop the bytes once none of them waits any more."""
    entry = block_hashes_box(seq)[0]
    if entry is not None and entry.contents is not None and num_sealed >= len(entry.contents):
        entry.contents = None
