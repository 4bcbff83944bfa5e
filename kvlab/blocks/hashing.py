"""Chained block hashes: the key under which the prefix cache finds a full block.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean (up to collisions)
equal prefixes, not merely equal blocks: the same tokens after a different prefix have different K/V and
must not hit. The default is xxh64 over the block's tokens as little-endian int64 bytes, seeded with the
parent's hash (the first block's seed is 0). Collisions are harmless for correctness: the pool compares
the tokens and the parent block before it shares anything (see ``BlockPool.lookup``).

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

from kvlab.blocks.sequence import key_bytes, token_buffer
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


def block_hashes(tokens: array, block_size: int, start: int, stop: int, parent: Optional[int],
                 hash_fn: Optional[HashFn] = None, keys: Optional[dict] = None) -> tuple[list[int], list[bytes]]:
    """Hashes and bytes of full blocks ``start..stop-1`` of ``tokens``, chained from ``parent`` (the hash of
    block ``start - 1``, or None for the first block); ``keys`` (``key_bytes(seq)``) extends keyed blocks."""
    raw = memoryview(tokens)[start * block_size:stop * block_size].tobytes()  # one copy, then cheap slices
    contents = _split_blocks(raw, 8 * block_size)
    if keys:
        for i, suffix in keys.items():
            if start <= i < stop:
                contents[i - start] += suffix
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


class PromptHashes:
    """``prompt_hashes(seq)``: hashes and bytes of a sequence's full blocks, remembering the last answer. A
    scheduler calls ``can_allocate`` then ``allocate`` on the same prompt, and hashing is a quarter of a
    replay's time. The key is the token array itself plus its length: tokens only change by appending, or
    by ``fork`` replacing the array (and the keys with it; a sequence's salt and keys never change otherwise),
    so two sequences with the same tokens and different salts never share an entry."""

    def __init__(self, block_size: int, hash_fn: Optional[HashFn]):
        self.block_size, self.hash_fn = block_size, hash_fn
        self._last = None  # (token array, its length, hashes, contents)

    def __call__(self, seq) -> tuple[list[int], list[bytes]]:
        tokens, last = token_buffer(seq), self._last
        if last is None or last[0] is not tokens or last[1] != len(tokens):
            hashes, contents = block_hashes(tokens, self.block_size, 0, len(tokens) // self.block_size, None,
                                            self.hash_fn, key_bytes(seq))
            last = self._last = (tokens, len(tokens), hashes, contents)
        return last[2], last[3]

    def forget(self) -> None:
        """Drop the remembered answer (``allocate`` consumed it). Kept until the next prompt, its lists would
        die when every block's bytes and hash have left the CPU cache: a cache miss each (5% of a replay's
        misses); dropped now, they die while those are still warm."""
        self._last = None
