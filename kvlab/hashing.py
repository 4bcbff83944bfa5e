"""Chained block hashes: the key under which the prefix cache finds a full block.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean (up to collisions)
equal prefixes, not merely equal blocks: the same tokens after a different prefix have different K/V and
must not hit. The default is xxh64 over the block's tokens as little-endian int64 bytes, seeded with the
parent's hash (the first block's seed is 0). Collisions are harmless for correctness: the pool compares
the tokens and the parent block before it shares anything (see ``BlockPool.lookup``).
"""

import sys
from array import array
from typing import Callable, Optional

import xxhash

from kvlab.errors import InvalidArgumentError

#: ``hash_fn(parent_hash_or_None, token_ids_tuple) -> int``, to replace the default in experiments/tests.
HashFn = Callable[[Optional[int], tuple], int]

if sys.byteorder != "little":
    raise ImportError("kvlab hashes tokens as native int64 bytes, which must be little-endian")


def block_hashes(tokens: array, block_size: int, start: int, stop: int, parent: Optional[int],
                 hash_fn: Optional[HashFn] = None) -> tuple[list[int], list[bytes]]:
    """Hashes and token bytes of full blocks ``start..stop-1`` of ``tokens``, chained from ``parent``
    (the hash of block ``start - 1``, or None for the first block)."""
    raw = memoryview(tokens)[start * block_size:stop * block_size].tobytes()  # one copy, then cheap slices
    width = 8 * block_size
    contents = [raw[offset:offset + width] for offset in range(0, len(raw), width)]
    hashes = []
    if hash_fn is None:
        xxh64, parent = xxhash.xxh64_intdigest, parent or 0
        for content in contents:
            parent = xxh64(content, parent)
            hashes.append(parent)
        return hashes, contents
    for i in range(start, stop):
        try:
            parent = hash_fn(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
        except Exception as e:
            raise InvalidArgumentError(f"hash_fn raised {type(e).__name__}: {e}") from e
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise InvalidArgumentError(f"hash_fn must return an int, got {type(parent).__name__}")
        hashes.append(parent)
    return hashes, contents
