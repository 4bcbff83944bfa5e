"""What besides its tokens decides whether a block may be shared: a tenant's salt, an adapter, per-block keys.

Equal tokens after an equal prefix do not always mean equal K/V, nor that sharing is allowed:

- ``cache_salt``: requests of different tenants must never share K/V, nor learn from a fast first token that
  someone else sent the same prompt (a prefix hit is a timing side channel). Different salts, different blocks.
- ``adapter_key``: a LoRA adapter (any change of weights) changes every K/V of the sequence.
- ``extra_keys`` ``{block index: key}``: what the tokens of one block do not show, such as the image whose
  placeholder tokens sit in it (every image has the same placeholder tokens, not the same K/V).

A keyed block's identity is its token bytes followed by the encoding below. The chained hash is taken over
those bytes and the pool compares those bytes on every lookup (``PrefixIndex.lookup``), so the verified lookup
covers the keys with no code of its own. A block without keys is its token bytes alone, as before: a block
with keys is longer, so the two never compare equal.

The salt and the adapter go into block 0 only (as vLLM V1 does with ``cache_salt``): every later block hashes
and verifies its parent, so one different block 0 separates the whole sequence. (vLLM mixes the LoRA name
into every block; with chained, verified blocks that draws the same lines and costs more.)

The encoding is canonical and unambiguous: each field has its own tag (so a salt never equals an adapter or a
block key with the same value), each value a type tag and a length (so 1, "1", b"1" and (1,) differ, and
("ab", "c") differs from ("a", "bc")). The fields are ``S`` (salt), ``A`` (adapter) and ``K`` (a block key).
(A hybrid model's KV cache groups are not keys: the same bytes in two groups are kept apart by the prefix
index, one namespace per group: kvlab.blocks.prefix_index.)
"""

import struct
from collections.abc import Mapping
from typing import NamedTuple, Optional

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, is_int

#: Tuples in keys nest at most this deep (an image key is ("img", hash, offset); several images, a tuple of those).
MAX_KEY_DEPTH = 8
_ALLOWED = f"a str, bytes, int, or a tuple of those (nested at most {MAX_KEY_DEPTH} deep)"
_LENGTH = struct.Struct("<Q")


class CacheKeys(NamedTuple):
    """A sequence's salt and keys as given, and ``block_bytes``: block index -> the bytes that follow that
    block's token bytes (only blocks that have keys)."""
    cache_salt: Optional[str | bytes]
    adapter_key: object
    extra_keys: dict
    block_bytes: dict


def cache_keys(cache_salt, adapter_key, extra_keys, max_block: int) -> Optional[CacheKeys]:
    """Validate and encode; None when there is nothing to mix in (the plain sequences' fast path). Raises
    InvalidArgumentError naming what is allowed."""
    if cache_salt is None and adapter_key is None and extra_keys is None:
        return None
    if cache_salt is not None and (not isinstance(cache_salt, (str, bytes)) or not cache_salt):
        # "" would look like "no salt" but isolate like a tenant of its own: refused, as vLLM refuses it.
        raise InvalidArgumentError(f"cache_salt must be None or a non-empty str or bytes, got {cache_salt!r}")
    if extra_keys is None:
        extra_keys = {}
    elif not isinstance(extra_keys, Mapping):
        raise InvalidArgumentError(f"extra_keys must be None or a mapping {{block index: key}}, got "
                                   f"{type(extra_keys).__name__}")
    header = []
    if cache_salt is not None:
        header.append(b"S" + encode_key(cache_salt, "cache_salt"))
    if adapter_key is not None:
        header.append(b"A" + encode_key(adapter_key, "adapter_key"))
    keys, block_bytes = {}, {}
    for index, key in extra_keys.items():
        index = check_int("an extra_keys block index", index, 0, max_block)
        keys[index] = key
        block_bytes[index] = b"K" + encode_key(key, f"extra_keys[{index}]")
    if header:
        block_bytes[0] = b"".join(header) + block_bytes.get(0, b"")
    if not block_bytes:
        return None
    return CacheKeys(cache_salt, adapter_key, keys, block_bytes)


def encode_key(key, name: str = "key") -> bytes:
    """The canonical bytes of a key (a str, bytes, int, or a tuple of those)."""
    out: list[bytes] = []
    _encode(key, out, 0, name)
    return b"".join(out)


def _encode(key, out: list, depth: int, name: str) -> None:
    if isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")  # injective on every str, lone surrogates included
        out += (b"s", _LENGTH.pack(len(data)), data)
    elif isinstance(key, bytes):
        out += (b"b", _LENGTH.pack(len(key)), key)
    elif is_int(key):
        value = int(key)
        data = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
        out += (b"i", _LENGTH.pack(len(data)), data)
    elif isinstance(key, tuple) and depth < MAX_KEY_DEPTH:
        out += (b"t", _LENGTH.pack(len(key)))
        for item in key:
            _encode(item, out, depth + 1, name)
    else:
        what = "a tuple nested too deep" if isinstance(key, tuple) else type(key).__name__
        raise InvalidArgumentError(f"{name} must be {_ALLOWED}, got {what}")
