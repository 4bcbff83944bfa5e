"""A request's tokens and where its KV cache lives (the unit the block manager allocates for), and what
besides its tokens decides whether its blocks may be shared (a tenant's salt, an adapter, per-block keys).
"""

from array import array
from collections.abc import Mapping
import enum
import itertools
import operator
import struct
import threading
from types import MappingProxyType
from typing import NamedTuple, Optional

import numpy as np

from kvlab.blocks.prefix_cache import BlockHashes
from kvlab.errors import InvalidArgumentError, SequenceStateError
from kvlab.validation import check_int, is_int


# ==== what besides its tokens makes a block distinct ==================================================================
# What besides its tokens decides whether a block may be shared: a tenant's salt, an adapter, per-block keys.
#
# Equal tokens after an equal prefix do not always mean equal K/V, nor that sharing is allowed:
#
# - ``cache_salt``: requests of different tenants must never share K/V, nor learn from a fast first token that
#   someone else sent the same prompt (a prefix hit is a timing side channel). Different salts, different blocks.
# - ``adapter_key``: a LoRA adapter (any change of weights) changes every K/V of the sequence.
# - ``extra_keys`` ``{block index: key}``: what the tokens of one block do not show, such as the image whose
#   placeholder tokens sit in it (every image has the same placeholder tokens, not the same K/V).
#
# A keyed block's identity is its token bytes followed by the encoding below. The chained hash is taken over
# those bytes and the pool compares those bytes on every lookup (``PrefixIndex.lookup``), so the verified lookup
# covers the keys with no code of its own. A block without keys is its token bytes alone, as before: a block
# with keys is longer, so the two never compare equal.
#
# The salt and the adapter go into block 0 only (as vLLM V1 does with ``cache_salt``): every later block hashes
# and verifies its parent, so one different block 0 separates the whole sequence. (vLLM mixes the LoRA name
# into every block; with chained, verified blocks that draws the same lines and costs more.)
#
# The encoding is canonical and unambiguous: each field has its own tag (so a salt never equals an adapter or a
# block key with the same value), each value a type tag and a length (so 1, "1", b"1" and (1,) differ, and
# ("ab", "c") differs from ("a", "bc")). The fields are ``S`` (salt), ``A`` (adapter) and ``K`` (a block key).
# (A hybrid model's KV cache groups are not keys: the same bytes in two groups are kept apart by the prefix
# index, one namespace per group: kvlab.blocks.prefix_cache.)

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


# ==== the sequence ====================================================================================================
# A request's tokens and where its KV cache lives: the unit the block manager allocates for.

_next_seq_id = itertools.count()
_ids_lock = threading.Lock()


def _skip_ids_through(seq_id: int) -> None:
    """New sequences get ids above ``seq_id`` (an unpickled sequence's), so ids stay unique per process."""
    global _next_seq_id
    with _ids_lock:
        _next_seq_id = itertools.count(max(next(_next_seq_id), seq_id + 1))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # not allocated (new, or preempted to be recomputed)
    RUNNING = "running"    # its blocks are in the GPU pool
    SWAPPED = "swapped"    # its blocks were moved to the CPU pool
    FINISHED = "finished"  # freed for good


#: Larger blocks only waste memory (vLLM's largest is 256); the bound keeps ``block_size * num_blocks`` sane.
MAX_BLOCK_SIZE = 1 << 16
#: Token ids are int64 everywhere outside the manager (torch tensors), so they stay below 2**63.
MAX_TOKEN_ID = (1 << 63) - 1
#: Positions are int32 in the kernels (seq_lens), and 2**31 tokens are 16 GiB of ids alone.
MAX_TOKENS = (1 << 31) - 1


def check_block_size(block_size) -> int:
    return check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)


def as_token_array(token_ids) -> array:
    """Token ids as an unsigned 64-bit ``array`` of values below 2**63 (the canonical little-endian bytes the
    prefix cache hashes).

    Accepts any iterable of Python/NumPy integers; a 1-D NumPy integer array takes a fast path with no
    per-token Python work (trace replays build prompts of ~10^4 tokens each this way). From a list, an
    unsigned array is built three times faster than a signed one (CPython converts "Q" items directly), and
    rejects negative ids by itself; ``fromlist`` converts a list a third faster again than the constructor.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"token_ids must be a 1-D integer array, got shape {token_ids.shape} dtype {token_ids.dtype}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > MAX_TOKEN_ID):
            raise InvalidArgumentError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        tokens = array("Q")
        tokens.frombytes(token_ids.astype(np.uint64, copy=False).tobytes())
        return tokens
    if isinstance(token_ids, (str, bytes)):
        raise InvalidArgumentError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:  # refused before any memory is taken
        too_long = hasattr(token_ids, "__len__") and len(token_ids) > MAX_TOKENS
    except OverflowError:  # a length beyond ssize_t, e.g. range(10**30)
        too_long = True
    if too_long:
        raise InvalidArgumentError(f"a sequence holds at most {MAX_TOKENS} tokens")
    try:
        if type(token_ids) is list:
            tokens = array("Q")
            tokens.fromlist(token_ids)
        else:
            tokens = array("Q", token_ids)
    except (TypeError, OverflowError) as e:
        raise InvalidArgumentError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {e}") from None
    if tokens and np.frombuffer(tokens, dtype=np.uint64).max() > MAX_TOKEN_ID:
        raise InvalidArgumentError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
    return tokens


class Sequence:
    """``Sequence(token_ids, block_size=16, *, cache_salt=None, adapter_key=None, extra_keys=None)``: a prompt
    that grows one token at a time while decoding.

    Logical block i holds token positions ``[i * block_size, (i + 1) * block_size)``; ``block_table[i]``
    is the physical block the manager gave it. Tokens are stored as an int64 array; ``token_ids``
    returns them as a new list. A sequence is allocated in at most one ``BlockManager`` at a time, and
    belongs to one thread at a time.

    Its blocks are shared with another sequence's only where the tokens, the prefix before them and these
    keys are all equal (see ``kvlab.blocks.sequence``): ``cache_salt`` (a non-empty str or bytes: a tenant,
    whose blocks no other salt shares), ``adapter_key`` (the LoRA adapter that computes all of its K/V) and
    ``extra_keys`` ``{block index: key}`` (e.g. the image whose placeholder tokens sit in that block; decode
    blocks count too). Keys are a str, bytes, int or a tuple of those. All three are fixed (``fork`` gives a
    child its parent's).
    """

    def __init__(self, token_ids, block_size: int = 16, *, cache_salt=None, adapter_key=None, extra_keys=None):
        self.block_size = check_block_size(block_size)
        self.cache_keys = cache_keys(cache_salt, adapter_key, extra_keys, (MAX_TOKENS - 1) // self.block_size)
        # {block index: bytes that follow its token bytes} for a salted or keyed sequence, else None (read-only)
        self.key_bytes = self.cache_keys.block_bytes if self.cache_keys is not None else None
        # Its token ids as uint64 (the bytes the prefix cache hashes; read-only), None in a decode-only copy.
        self.token_array: array | None = as_token_array(token_ids)
        self.seq_id: int = next(_next_seq_id)
        self.status = SequenceStatus.WAITING
        self.num_tokens = len(self.token_array)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0      # prompt tokens whose K/V came from the prefix cache
        # Times the manager freed it to be recomputed (free(seq, preempted=True)): once it is > 0, its lookups
        # find its own blocks again and count as recomputed, not as prefix hits (PrefixCacheStats).
        self.num_preemptions = 0
        # How far it got (vLLM V1's request.num_computed_tokens). Invariant: positions < num_computed_tokens
        # have slots in its block table and their K/V is written by now or by the step just scheduled; the
        # tokens after them still need a step. 0 while it holds no blocks. Whoever schedules it writes it (the
        # engine's scheduler; ``BlockManager`` for callers without one), with the progress calls below, from
        # what the manager's calls return; the manager reads it and audits it against its records.
        self.num_computed_tokens = 0
        # Of those positions, the last num_draft_tokens hold proposed tokens not verified yet (speculative
        # decoding: kvlab.blocks.group_manager). They are not in the token list, and the manager seals (makes
        # hittable) only positions < num_computed_tokens - num_draft_tokens.
        self.num_draft_tokens = 0
        # Positions < prefill_end are prefilled (set when allocated: the prompt, or everything a sequence
        # preempted by recompute had); later ones are decoded, one sampled token at a time.
        self.prefill_end = 0
        self.last_token: int | None = self.token_array[-1] if self.token_array else None
        # What the block manager keeps on the sequence (public, so no class reads another's private fields; neither is
        # the user's to change): its record in the manager holding it (group 0's
        # ``kvlab.blocks.group_manager.Allocation``, None when not allocated), and its full blocks' hashes.
        self.allocation = None
        # Hashed under the default hash_fn as blocks fill (a manager with another one hashes it anew), once in
        # its life, as vLLM V1's request.block_hashes.
        self.block_hashes = BlockHashes(self.block_size, None, self.key_bytes)

    # ---- progress: what a scheduler writes after each manager call (vLLM V1's scheduler owns it too) ----------
    def start_running(self, admitted) -> None:
        """``KVCacheManager.allocate`` returned ``admitted`` (an ``Admitted``): it runs, prefilling what it has."""
        self.status, self.num_cached_tokens, self.prefill_end = (SequenceStatus.RUNNING, admitted.num_cached_tokens,
                                                                 self.num_tokens)
        self.num_computed_tokens = admitted.num_computed_tokens

    def scheduled_through(self, num_computed_tokens: int, num_draft_tokens: int = 0) -> None:
        """A step gave positions up to ``num_computed_tokens`` slots, its last ``num_draft_tokens`` for drafts."""
        self.num_computed_tokens, self.num_draft_tokens = num_computed_tokens, num_draft_tokens

    def stopped(self, preempted: bool) -> None:
        """``KVCacheManager.free`` took its blocks: it finished, or (``preempted``) waits to be recomputed."""
        self.num_computed_tokens = self.prefill_end = self.num_draft_tokens = 0  # no slots: it starts over
        self.status = SequenceStatus.WAITING if preempted else SequenceStatus.FINISHED
        if preempted:
            self.num_cached_tokens = 0
            self.num_preemptions += 1

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")

    @property
    def block_table(self) -> tuple:
        """Physical block of each logical block (CPU block ids while swapped out; the null block 0 where a
        sliding window released it); empty when not allocated. A read-only copy: the manager owns the
        table."""
        return tuple(self.allocation.table) if self.allocation is not None else ()

    @property
    def cache_salt(self):
        return self.cache_keys.cache_salt if self.cache_keys is not None else None

    @property
    def adapter_key(self):
        return self.cache_keys.adapter_key if self.cache_keys is not None else None

    @property
    def extra_keys(self):
        """``{block index: key}``, read-only: the blocks' hashes depend on it."""
        return MappingProxyType(self.cache_keys.extra_keys if self.cache_keys is not None else {})

    @property
    def token_ids(self) -> list[int]:
        return self._token_array().tolist()

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids of positions ``start .. stop - 1`` (clipped as a slice is), copying only those: a decode
        step takes one token, where ``token_ids[start:stop]`` would copy the whole sequence first."""
        return self._token_array()[start:stop].tolist()

    @property
    def is_prefilling(self) -> bool:
        """Its next step computes prompt (or recomputed) tokens, not one decoded token."""
        return self.num_computed_tokens < self.prefill_end

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed to hold the tokens: ceil(num_tokens / block_size)."""
        return -(-self.num_tokens // self.block_size)

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i`` (the last one may be partial)."""
        check_int("block index", i, 0, self.num_blocks - 1)
        return self._token_array()[i * self.block_size:(i + 1) * self.block_size].tolist()

    def append_token(self, token_id) -> None:
        """Add one generated token (then call ``BlockManager.append_slots`` to give it a slot)."""
        try:
            token = operator.index(token_id)
        except TypeError:
            raise InvalidArgumentError(f"token id must be an int, got {type(token_id).__name__}") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise InvalidArgumentError(f"token id must be in [0, {MAX_TOKEN_ID}], got {token}")
        if self.token_array is not None:
            self.token_array.append(token)
        self.num_tokens += 1
        self.last_token = token

    def _token_array(self) -> array:
        if self.token_array is None:
            raise SequenceStateError(
                f"sequence {self.seq_id} is a decode-only copy (unpickled while decoding): it carries "
                "last_token, not the token list")
        return self.token_array

    # Pickling, for sending a sequence to a worker process: a waiting sequence sends its prompt; once it
    # decodes, the worker already has the prompt, so only the newest token travels and the message
    # size stays flat however long the sequence grows. The copy is never allocated: the manager's record
    # stays with the original.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["allocation"] = None
        state["block_hashes"] = None  # as long as the prompt again, and cheap to recompute
        if self.num_completion_tokens > 0:
            state["token_array"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        _skip_ids_through(self.seq_id)


def copy_tokens(parent: Sequence, child: Sequence) -> None:
    """Give ``child`` the parent's tokens, counters and status, salt and keys (``fork``), and its block hashes with
    them: the child's own ones were of other tokens."""
    child.token_array = array("Q", parent.token_array)
    child.cache_keys, child.key_bytes = parent.cache_keys, parent.key_bytes
    child.block_hashes = parent.block_hashes.copy() if parent.block_hashes is not None else None
    child.num_tokens, child.num_prompt_tokens = parent.num_tokens, parent.num_prompt_tokens
    child.last_token, child.num_cached_tokens = parent.last_token, parent.num_cached_tokens
    child.num_computed_tokens, child.prefill_end = parent.num_computed_tokens, parent.prefill_end
    child.num_draft_tokens, child.status = parent.num_draft_tokens, parent.status
