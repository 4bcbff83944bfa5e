"""A request's tokens and where its KV cache lives: the unit the block manager allocates for."""

import enum
import itertools
import operator
from array import array

import numpy as np

from kvlab.errors import InvalidArgumentError, SequenceStateError

_next_seq_id = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # not allocated (new, or preempted to be recomputed)
    RUNNING = "running"    # its blocks are in the GPU pool
    SWAPPED = "swapped"    # its blocks were moved to the CPU pool
    FINISHED = "finished"  # freed for good


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def as_token_array(token_ids) -> array:
    """Token ids as an int64 ``array`` (the canonical bytes the prefix cache hashes).

    Accepts any iterable of Python/NumPy integers; a 1-D NumPy integer array takes a fast path with no
    per-token Python work (trace replays build prompts of ~10^4 tokens each this way).
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"token_ids must be a 1-D integer array, got shape {token_ids.shape} dtype {token_ids.dtype}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > np.iinfo(np.int64).max):
            raise InvalidArgumentError("token ids must be integers in [0, 2**63)")
        tokens = array("q")
        tokens.frombytes(token_ids.astype(np.int64, copy=False).tobytes())
        return tokens
    if isinstance(token_ids, (str, bytes)):
        raise InvalidArgumentError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        tokens = array("q", token_ids)
    except (TypeError, OverflowError) as e:
        raise InvalidArgumentError(f"token ids must be integers in [0, 2**63): {e}") from None
    if tokens and min(tokens) < 0:
        raise InvalidArgumentError(f"token ids must be non-negative, got {min(tokens)}")
    return tokens


class Sequence:
    """``Sequence(token_ids, block_size=16)``: a prompt that grows one token at a time while decoding.

    Logical block i holds token positions ``[i * block_size, (i + 1) * block_size)``; ``block_table[i]``
    is the physical block the manager gave it. Tokens are stored as an int64 array; ``token_ids``
    returns them as a new list.
    """

    def __init__(self, token_ids, block_size: int = 16):
        self.block_size = check_block_size(block_size)
        self._tokens: array | None = as_token_array(token_ids)
        self.seq_id: int = next(_next_seq_id)
        self.status = SequenceStatus.WAITING
        self.num_tokens = len(self._tokens)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0      # prompt tokens whose K/V came from the prefix cache
        self.last_token: int | None = self._tokens[-1] if self._tokens else None
        self.block_table: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")

    @property
    def token_ids(self) -> list[int]:
        return self._token_array().tolist()

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed to hold the tokens: ceil(num_tokens / block_size)."""
        return -(-self.num_tokens // self.block_size)

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i`` (the last one may be partial)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_blocks:
            raise InvalidArgumentError(f"block index must be an int in [0, {self.num_blocks}), got {i!r}")
        return self._token_array()[i * self.block_size:(i + 1) * self.block_size].tolist()

    def append_token(self, token_id) -> None:
        """Add one generated token (then call ``BlockManager.append_slots`` to give it a slot)."""
        try:
            token = operator.index(token_id)
        except TypeError:
            raise InvalidArgumentError(f"token id must be an int, got {type(token_id).__name__}") from None
        if not 0 <= token < 2**63:
            raise InvalidArgumentError(f"token id must be in [0, 2**63), got {token}")
        if self._tokens is not None:
            self._tokens.append(token)
        self.num_tokens += 1
        self.last_token = token

    def _token_array(self) -> array:
        if self._tokens is None:
            raise SequenceStateError(
                f"sequence {self.seq_id} is a decode-only copy (unpickled while decoding): it carries "
                "last_token, not the token list")
        return self._tokens

    # Pickling, for sending a sequence to a worker process: a waiting sequence sends its prompt; once it
    # decodes, the worker already has the prompt, so only the newest token travels and the message
    # size stays flat however long the sequence grows.
    def __getstate__(self):
        state = self.__dict__.copy()
        if self.num_completion_tokens > 0:
            state["_tokens"] = None
        return state
