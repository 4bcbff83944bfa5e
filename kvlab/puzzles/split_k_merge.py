"""Puzzle: merge split-K partitions of decode attention, in torch. Read first: notebook 05 (§2 and §4).

**Spec.** For a long context, decode attention runs in P partitions, each over a contiguous part of the keys
(notebook 05 §4). For its part, partition j of a (sequence, head) returned: its output ``partial_out[j]``
``[D]``, already normalised over its own keys (``softmax(scores_j) @ V_j``), the maximum of its scores
``partial_max[j]``, and its sum of exponentials ``partial_sum[j] = sum(exp(scores_j - partial_max[j]))``.
Merge them into the attention over all the keys, exactly as one softmax over every score would give::

    M = max_j partial_max[j]
    out = sum_j partial_sum[j] * exp(partial_max[j] - M) * partial_out[j]  /  sum_j partial_sum[j] * exp(partial_max[j] - M)

Shapes: ``partial_out [S, P, H, D]``, ``partial_max`` and ``partial_sum [S, P, H]`` (float32), and
``num_partitions [S]`` (int): sequence s used only its first ``num_partitions[s]`` partitions (a short context
needs fewer); the rest hold stale values (``check`` fills them with NaN and huge numbers). Return
``out [S, H, D]``.

``check`` builds the partitions from random scores and values, and compares your merge with the attention over
every key at once (scores up to a few hundred apart: a merge that exponentiates a score without subtracting a
maximum overflows).
"""

import random

import torch

from kvlab.kernels.torch_paged import split_k_partitions
from kvlab.puzzles.grading import Case, Report, grade, seeded

NAME = "split_k_merge"
TOLERANCE = 1e-4


def split_k_merge(partial_out: torch.Tensor, partial_max: torch.Tensor, partial_sum: torch.Tensor,
                  num_partitions: torch.Tensor) -> torch.Tensor:
    """``out [S, H, D]`` from the partitions' results (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 20) -> Report:
    """Run ``fn`` on ``num_cases`` random split decodes (from ``seed``) against unsplit attention."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    seqs, heads, dim, max_parts = rng.randint(1, 3), rng.randint(1, 3), rng.choice((3, 8)), rng.randint(1, 4)
    part_len = rng.randint(1, 5)
    spread = rng.choice((1.0, 30.0, 300.0))  # scores that far apart overflow exp() unless a maximum is taken out
    parts = [rng.randint(1, max_parts) for _ in range(seqs)]
    partial_out = torch.full((seqs, max_parts, heads, dim), float("nan"))
    partial_max = torch.full((seqs, max_parts, heads), 1e30)   # stale partitions: huge and NaN
    partial_sum = torch.full((seqs, max_parts, heads), float("nan"))
    expected = torch.empty(seqs, heads, dim)
    for s, num in enumerate(parts):
        scores = torch.randn(heads, num * part_len, generator=generator) * spread
        values = torch.randn(num * part_len, dim, generator=generator)
        expected[s] = scores.softmax(-1) @ values
        per_head = values[:, None].expand(-1, heads, -1)  # [n, H, D]: every head reads the same values
        partial_out[s, :num], partial_max[s, :num], partial_sum[s, :num] = split_k_partitions(scores, per_head,
                                                                                              part_len)
    num_partitions = torch.tensor(parts)
    inputs = (f"S={seqs}, P={max_parts}, H={heads}, D={dim}, num_partitions={parts}, {part_len} "
              f"key{'s' if part_len > 1 else ''} per partition, scores spread x{spread:g}")
    return Case(inputs, lambda fn: fn(partial_out.clone(), partial_max.clone(), partial_sum.clone(),
                                      num_partitions.clone()),
                lambda got: _judge(expected, got, parts))


def _judge(expected: torch.Tensor, got, parts) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = f"shape {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return f"expected a tensor of shape {list(expected.shape)} [S, H, D], got {shape}"
    for s in range(expected.shape[0]):
        if not got[s].isfinite().all():
            return (f"sequence {s}'s output is not finite: it used a stale partition (only the first {parts[s]} "
                    "count) or exponentiated a score without subtracting the maximum")
        error = (got[s] - expected[s]).abs().amax(-1)
        if error.max() > TOLERANCE:
            h = int(error.argmax())
            return (f"sequence {s}, head {h}: max abs error {error[h]:.3g} (allowed {TOLERANCE}): each partition "
                    "weighs partial_sum * exp(partial_max - M), its share of the whole softmax")
    return None
