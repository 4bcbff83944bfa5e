"""Puzzle: prefill over a cached prefix, in torch. Read first: notebook 06.

**Spec.** A sequence of ``seq_len`` tokens was admitted with a prefix hit: its first ``seq_len - T`` tokens'
K/V were already in the cache, and this step computed the last T (their K/V are written too: the cache holds
all ``seq_len`` positions). ``query [T, H, D]`` holds the new tokens' queries: row i is position
``seq_len - T + i``, and it attends **causally**, to positions ``0 .. seq_len - T + i``. Keys and values live in
``kv_cache [num_blocks, 2, block_size, H_kv, D]`` at block ``block_table[p // block_size]``, offset
``p % block_size`` (``block_table`` int32 ``[num_table_blocks]``); query head h reads KV head
``h // (H // H_kv)``. Return ``out [T, H, D]``, computed in float32::

    out[i, h] = softmax(scale * K[:p + 1] @ query[i, h]) @ V[:p + 1]      (p = seq_len - T + i)

``check`` fills every slot that holds no token with NaN, and compares your output with kvlab's torch path
(``paged_prefill_torch``) on tiny odd shapes, prefixes of every length (none, part of a block, whole blocks).
"""

import random

import torch

from kvlab.kernels.torch_paged import paged_prefill_torch
from kvlab.puzzles.grading import Case, Report, grade, seeded

NAME = "prefill_attention"
TOLERANCE = 1e-4


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                      scale: float) -> torch.Tensor:
    """``out [T, H, D]``: the new tokens' causal attention over the whole paged context (see the module
    docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 12) -> Report:
    """Run ``fn`` on ``num_cases`` random prefills (from ``seed``) against kvlab's torch prefill."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    bs, kv_heads, group, dim = rng.choice((1, 2, 4, 8)), rng.randint(1, 2), rng.randint(1, 3), rng.choice((16, 24))
    seq_len = rng.randint(1, 4 * bs + 2)
    new = rng.randint(1, seq_len)  # the cached prefix: seq_len - new tokens (0 .. seq_len - 1)
    used = -(-seq_len // bs)
    num_blocks = used + 2
    kv_cache = torch.full((num_blocks, 2, bs, kv_heads, dim), float("nan"))
    blocks = torch.randperm(num_blocks, generator=generator)[:used].tolist()
    for p in range(seq_len):
        kv_cache[blocks[p // bs], :, p % bs] = torch.randn(2, kv_heads, dim, generator=generator)
    table = torch.tensor(blocks, dtype=torch.int32)
    query = torch.randn(new, kv_heads * group, dim, generator=generator)
    scale = rng.choice((dim ** -0.5, 0.25))
    expected = paged_prefill_torch(query, kv_cache, table[None], torch.tensor([seq_len], dtype=torch.int32),
                                   torch.tensor([0, new], dtype=torch.int32), scale=scale)
    inputs = (f"T={new} new tokens after a cached prefix of {seq_len - new}, seq_len={seq_len}, block_size={bs}, "
              f"H={kv_heads * group}, H_kv={kv_heads}, D={dim}, scale={scale:.4g}, block_table={blocks}")
    return Case(inputs, lambda fn: fn(query.clone(), kv_cache.clone(), table.clone(), seq_len, scale),
                lambda got: _judge(expected, got, seq_len, new))


def _judge(expected: torch.Tensor, got, seq_len: int, new: int) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        shape = (f"a {got.dtype} tensor of shape {list(got.shape)}" if isinstance(got, torch.Tensor)
                 else type(got).__name__)
        return f"expected a {expected.dtype} tensor of shape {list(expected.shape)} [T, H, D], got {shape}"
    for i in range(new):
        position = seq_len - new + i
        if got[i].isnan().any():
            return (f"row {i} (position {position}) has NaN: it read a slot that holds no token (positions "
                    f"0 .. {seq_len - 1} hold tokens)")
        error = (got[i] - expected[i]).abs().amax(-1)  # [H]
        if error.max() > TOLERANCE:
            h = int(error.argmax())
            return (f"row {i} (position {position}), query head {h}: max abs error {error[h]:.3g} (allowed "
                    f"{TOLERANCE}): it must see positions 0 .. {position}, no later one")
    return None
