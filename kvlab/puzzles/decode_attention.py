"""Puzzle: decode attention over a block table, in torch. Read first: notebook 05 (§1 and §3).

**Spec.** Each of S sequences decodes one token: ``query[s]`` ``[H, D]`` sits at position ``seq_lens[s] - 1``
and attends to the sequence's keys at positions ``0 .. seq_lens[s] - 1``. Those live in the paged cache
``kv_cache [num_blocks, 2, block_size, H_kv, D]`` (K = ``kv_cache[:, 0]``, V = ``kv_cache[:, 1]``): position p
of sequence s is at block ``block_tables[s, p // block_size]``, offset ``p % block_size``. ``block_tables`` is
int32 ``[S, max_blocks]`` and ``seq_lens`` int32 ``[S]``. Query head h reads KV head ``h // (H // H_kv)``
(grouped-query attention). Return ``out [S, H, D]`` in the query's dtype, computed in float32::

    out[s, h] = softmax(scale * K_s @ query[s, h]) @ V_s     (K_s, V_s: [seq_lens[s], D] of head h's KV head)

Read only the slots that hold a token: ``check`` fills every other slot of the cache with NaN (the rest of a
sequence's last block, blocks no table uses, table entries past a sequence's end), as a real cache holds
stale data there. It compares your output with kvlab's torch path (``paged_attention_decode_torch``) on tiny,
odd shapes.
"""

import random

import torch

from kvlab.kernels.torch_paged import paged_attention_decode_torch
from kvlab.puzzles.grading import Case, Report, grade, seeded

NAME = "decode_attention"
TOLERANCE = 1e-4


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``out [S, H, D]``: each sequence's one query over its paged context (see the module docstring). Your
    code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 12) -> Report:
    """Run ``fn`` on ``num_cases`` random batches (from ``seed``) against kvlab's torch paged attention."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    bs, kv_heads, group, dim = rng.choice((1, 2, 4, 8)), rng.randint(1, 3), rng.randint(1, 3), rng.choice((16, 24))
    lens = [rng.randint(1, 3 * bs + 1) for _ in range(rng.randint(1, 4))]
    used = [-(-n // bs) for n in lens]
    num_blocks = sum(used) + rng.randint(1, 3)  # some blocks no table uses
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    kv_cache = torch.full((num_blocks, 2, bs, kv_heads, dim), float("nan"))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    poisoned = order[sum(used)]  # an unused block: table entries past a sequence's end point at it
    tables = torch.full((len(lens), max(used) + rng.randint(0, 1)), poisoned, dtype=torch.int32)
    for s, n in enumerate(lens):
        blocks, order = order[:used[s]], order[used[s]:]
        tables[s, :used[s]] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(n):  # only slots that hold a token get numbers
            kv_cache[blocks[p // bs], :, p % bs] = torch.randn(2, kv_heads, dim, generator=generator)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), kv_heads * group, dim, generator=generator)
    scale = rng.choice((dim ** -0.5, 0.3))
    expected = paged_attention_decode_torch(query, kv_cache, tables, seq_lens, scale=scale)
    inputs = (f"S={len(lens)} sequences, seq_lens={lens}, block_size={bs}, H={kv_heads * group} query heads, "
              f"H_kv={kv_heads}, head_dim={dim}, scale={scale:.4g}, block_tables={tables.tolist()}")
    return Case(inputs, lambda fn: fn(query.clone(), kv_cache.clone(), tables.clone(), seq_lens.clone(), scale),
                lambda got: _judge(expected, got, lens, bs))


def _judge(expected: torch.Tensor, got, lens, bs) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        shape = (f"a {got.dtype} tensor of shape {list(got.shape)}" if isinstance(got, torch.Tensor)
                 else type(got).__name__)
        return f"expected a {expected.dtype} tensor of shape {list(expected.shape)} [S, H, D], got {shape}"
    for s, n in enumerate(lens):
        if got[s].isnan().any():
            return (f"sequence {s}'s output has NaN: it read a slot that holds no token (its seq_len is {n}: only "
                    f"offsets 0 .. {(n - 1) % bs} of its last block ({-(-n // bs) - 1}) hold tokens, and table "
                    "entries past it point at stale blocks)")
        error = (got[s] - expected[s]).abs().amax(-1)  # [H]
        if error.max() > TOLERANCE:
            h = int(error.argmax())
            return (f"sequence {s}, query head {h}: max abs error {error[h]:.3g} (allowed {TOLERANCE}): expected "
                    f"{_short(expected[s, h])}, got {_short(got[s, h])}")
    return None


def _short(row: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in row[:4].tolist()) + ", ...]"
