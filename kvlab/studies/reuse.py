"""Block reuse in a trace, independent of any cache: which full prompt blocks repeat, and how often.

Every full block of every prompt gets a *key* naming its whole prefix (block i of a prompt is the same
block as block i of another prompt exactly when their first (i + 1) * block_size tokens agree, which is
when a prefix cache could share it). From the keys, in arrival order, follow:
- the infinite-cache ceiling: the hit rate of a cache that never evicts, i.e. the fraction of blocks seen
  before (within the manager's rule that a prompt's last token is always computed, so a prompt that is a
  whole number of blocks never hits its last block);
- the share of distinct blocks that are never reused (filled once, never hit by any later request);
- the number of distinct blocks, which sizes a pool that never has to evict.
"""

import numpy as np
import pandas as pd

from kvlab.blocks.sequence import check_block_size
from kvlab.errors import InvalidArgumentError
from kvlab.studies.traces import PromptTokens, hash_id_tokens


def _id_prefix_numbers(hash_ids: list, id_tokens: np.ndarray) -> np.ndarray:
    """For every hash id of every request, flattened: a number naming the request's ids up to that one. In a
    real Mooncake trace an id already names its prefix, but nothing in a file guarantees it. Ids of different
    sizes (``id_tokens``) stand for different tokens, so their prefixes start from different roots."""
    known: dict[tuple[int, int], int] = {}
    numbers = []
    for ids, tokens in zip(hash_ids, id_tokens.tolist()):
        parent = -tokens
        for h in ids.tolist():
            parent = known.setdefault((parent, h), len(known))
            numbers.append(parent)
    return np.array(numbers, dtype=np.int64)


def _hash_id_keys(hash_ids: list, lengths: np.ndarray, id_tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Keys for prompts given as hash ids of ``id_tokens`` tokens each (Mooncake: 512): one per full block."""
    num_full = lengths // block_size
    starts = np.cumsum(num_full) - num_full
    request = np.repeat(np.arange(len(lengths)), num_full)
    ends = (np.arange(num_full.sum()) - starts[request] + 1) * block_size   # p, one per full block
    return _hash_id_prefix_keys(hash_ids, lengths, id_tokens, request, ends)


def _hash_id_prefix_keys(hash_ids: list, lengths: np.ndarray, id_tokens: np.ndarray, request: np.ndarray,
                         ends: np.ndarray) -> np.ndarray:
    """The key of the prefix of request ``request[k]`` ending at token ``ends[k]``, for every k. The prefix ending
    at token p is the expansion of the ids up to the one covering token p - 1, cut p - id_tokens * (its index)
    tokens into it, so the key is that id prefix's number * (2 * the largest id_tokens) + those tokens;
    vectorised over the whole trace but for one dict lookup per id."""
    id_counts = np.array([len(h) for h in hash_ids], dtype=np.int64)
    if (id_counts * id_tokens < lengths).any():
        r = int(np.flatnonzero(id_counts * id_tokens < lengths)[0])
        raise InvalidArgumentError(f"request {r}: {id_counts[r]} hash ids cannot cover input_length {lengths[r]}")
    tokens = id_tokens[request]
    index = (ends - 1) // tokens
    prefixes = _id_prefix_numbers(hash_ids, id_tokens)
    id_starts = np.cumsum(id_counts) - id_counts
    return prefixes[id_starts[request] + index] * (2 * int(id_tokens.max(initial=1))) + (ends - tokens * index)


def _token_keys(prompts: PromptTokens, block_size: int) -> np.ndarray:
    """Keys for explicit token ids: a dict from (parent key, block bytes) to a number, exact (no hash
    collisions), about a microsecond per block: meant for synthetic and hand-built traces."""
    known: dict[tuple[int, bytes], int] = {}
    keys = []
    for i in range(len(prompts)):
        tokens = prompts[i]
        parent = -1
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = known.setdefault((parent, tokens[start:start + block_size].tobytes()), len(known))
            keys.append(parent)
    return np.array(keys, dtype=np.int64)


def block_keys(trace: pd.DataFrame, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, request)``: one prefix key per full prompt block, in request order, and the index of the
    request each belongs to. Two keys are equal exactly when the prefixes their blocks end are equal:
    requests without hash ids or token ids (Azure) get keys no other shares."""
    block_size = check_block_size(block_size)
    lengths = trace["input_length"].to_numpy(np.int64)
    num_full = lengths // block_size
    request = np.repeat(np.arange(len(trace)), num_full)
    explicit = "token_ids" in trace and trace["token_ids"].notna().any()
    hashed = trace["hash_ids"].notna() if "hash_ids" in trace else pd.Series(False, index=trace.index)
    if not explicit and hashed.all():
        return _hash_id_keys(trace["hash_ids"].tolist(), lengths, hash_id_tokens(trace), block_size), request
    if explicit or hashed.any():  # a mix: follow the tokens a replay would see, one block at a time
        return _token_keys(PromptTokens(trace), block_size), request
    return -1 - np.arange(num_full.sum(), dtype=np.int64), request  # private blocks: all distinct


def _token_probe_keys(prompts: PromptTokens, block_size: int) -> np.ndarray:
    """Probe keys for explicit token ids: (the prefix key before the unit, its first token), numbered."""
    known: dict[tuple[int, bytes], int] = {}
    probes: dict[tuple[int, int], int] = {}
    keys = []
    for i in range(len(prompts)):
        tokens = prompts[i]
        parent = -1
        for start in range(0, len(tokens), block_size):
            keys.append(probes.setdefault((parent, int(tokens[start])), len(probes)))
            if start + block_size <= len(tokens):
                parent = known.setdefault((parent, tokens[start:start + block_size].tobytes()), len(known))
    return np.array(keys, dtype=np.int64)


def unit_probe_keys(trace: pd.DataFrame, block_size: int) -> np.ndarray:
    """One key per unit of every prompt (its full blocks, then its partial last block if any), in request
    order: two units' keys are equal exactly when the prefixes ending at their first tokens are (the prompts
    agree up to and including that token). The hit-rate doctor (kvlab.studies.doctor) reads them to tell a
    prefix shared into a block (a partial block) from a block never seen (cold)."""
    block_size = check_block_size(block_size)
    lengths = trace["input_length"].to_numpy(np.int64)
    units = -(-lengths // block_size)
    explicit = "token_ids" in trace and trace["token_ids"].notna().any()
    hashed = trace["hash_ids"].notna() if "hash_ids" in trace else pd.Series(False, index=trace.index)
    if not explicit and hashed.all():
        request = np.repeat(np.arange(len(trace)), units)
        ends = (np.arange(units.sum()) - (np.cumsum(units) - units)[request]) * block_size + 1
        return _hash_id_prefix_keys(trace["hash_ids"].tolist(), lengths, hash_id_tokens(trace), request, ends)
    if explicit or hashed.any():
        return _token_probe_keys(PromptTokens(trace), block_size)
    return -1 - np.arange(units.sum(), dtype=np.int64)  # private prompts: no unit is shared


def reuse_profile(trace: pd.DataFrame, block_size: int, *, keys=None) -> dict:
    """Block reuse statistics of ``trace`` (rows in arrival order) at ``block_size``; ``keys`` is
    ``block_keys(trace, block_size)`` if already computed."""
    keys, request = block_keys(trace, block_size) if keys is None else keys
    lengths = trace["input_length"].to_numpy()
    _, first, inverse, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    seen_before = request[first][inverse] < request          # an earlier request filled this block
    position = np.arange(len(keys)) - (np.cumsum(lengths // block_size) - lengths // block_size)[request]
    hittable = position < (lengths[request] - 1) // block_size  # the last token is always computed
    hits = int((seen_before & hittable).sum())
    return {
        "block_size": block_size,
        "prompt_tokens": int(lengths.sum()),
        "full_blocks": len(keys),
        "distinct_blocks": len(counts),
        "ceiling_hit_rate_blocks": hits / len(keys) if len(keys) else 0.0,
        "ceiling_hit_rate_tokens": float(hits * block_size / lengths.sum()),
        "never_reused": float((counts == 1).mean()) if len(counts) else 0.0,
    }


def reuse_counts(trace: pd.DataFrame, block_size: int) -> np.ndarray:
    """How many requests use each distinct full block (1 = never reused)."""
    return np.unique(block_keys(trace, block_size)[0], return_counts=True)[1]


def consecutive_hit_rates(trace: pd.DataFrame, block_size: int, by=("session", "agent")) -> pd.DataFrame:
    """Per stream of requests (the rows sharing their ``by`` values, in trace order): how much of each prompt
    the stream's previous prompt already held, i.e. the hit rate of a prefix cache that keeps exactly the
    previous request of the stream (the figure kv-cache-tester's README publishes for its sessions). A
    stream's first request hits nothing; the manager's rule that a prompt's last token is always computed
    holds. One row per stream, indexed by ``by``: requests, prompt_tokens, full_blocks, hit_blocks,
    hit_rate_blocks (hit_blocks / full_blocks) and hit_rate_tokens (hit_blocks * block_size / prompt_tokens)."""
    by = [by] if isinstance(by, str) else list(by)
    if not by or not set(by) <= set(trace.columns):
        raise InvalidArgumentError(f"streams are named by trace columns; {by} are not all among "
                                   f"{', '.join(map(str, trace.columns))}")
    block_size = check_block_size(block_size)
    keys, request = block_keys(trace, block_size)
    lengths = trace["input_length"].to_numpy(np.int64)
    num_full = lengths // block_size
    starts = np.cumsum(num_full) - num_full
    stream = trace.groupby(by, sort=False, dropna=False).ngroup().to_numpy()
    previous = pd.Series(np.arange(len(trace))).groupby(stream).shift(1).fillna(-1).to_numpy(np.int64)
    # Prefix keys: block p of a prompt equals block p of the previous one exactly when the whole prefix does.
    before = previous[request]
    position = np.arange(len(keys)) - starts[request]
    held = (before >= 0) & (position < num_full[np.maximum(before, 0)])
    same = np.zeros(len(keys), dtype=bool)
    same[held] = keys[held] == keys[starts[before[held]] + position[held]]
    hits = same & (position < (lengths[request] - 1) // block_size)  # the last token is always computed
    per_request = pd.DataFrame({"stream": stream, "requests": 1, "prompt_tokens": lengths, "full_blocks": num_full,
                                "hit_blocks": np.bincount(request[hits], minlength=len(trace))})
    streams = per_request.groupby("stream").sum()
    streams.index = trace.groupby(by, sort=False, dropna=False).size().index
    streams["hit_rate_blocks"] = streams["hit_blocks"] / streams["full_blocks"].where(streams["full_blocks"] > 0)
    streams["hit_rate_tokens"] = streams["hit_blocks"] * block_size / streams["prompt_tokens"]
    return streams
