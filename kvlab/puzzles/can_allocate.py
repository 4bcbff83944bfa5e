"""Puzzle: admission with a watermark. Read first: notebook 01 (§4) and notebook 10a (§2).

**Spec.** A pool of ``num_blocks`` blocks with ``watermark`` w keeps ``int(w * num_blocks)`` blocks free at
admission, so the sequences already running can still grow for a while before one must be preempted. A new
prompt of ``num_tokens`` tokens (no prefix cache here) needs ``ceil(num_tokens / block_size)`` blocks, and
``num_free_blocks`` are free now. Answer with an ``AllocStatus`` (``kvlab.blocks.AllocStatus``):

* ``NEVER`` if it needs more than ``num_blocks`` less the watermark's blocks: it could never be admitted,
  not even into an empty pool;
* ``OK`` if taking its blocks leaves at least the watermark's blocks free;
* ``LATER`` otherwise: it fits once other sequences finish.

``check`` compares your answer with ``BlockManager.can_allocate`` on pools that other sequences partly fill,
many of them right at a boundary.
"""

import random

from kvlab.blocks import AllocStatus, BlockManager, Sequence
from kvlab.puzzles.grading import Case, Report, grade, seeded

NAME = "can_allocate"
WATERMARKS = (0.0, 0.01, 0.04, 0.1, 0.15, 0.3)


def can_allocate(num_tokens: int, block_size: int, num_free_blocks: int, num_blocks: int,
                 watermark: float) -> AllocStatus:
    """OK, LATER or NEVER for a prompt of ``num_tokens`` tokens (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 300) -> Report:
    """Run ``fn`` on ``num_cases`` random pools and prompts (from ``seed``) against kvlab's own admission."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    bs, num_blocks, watermark = rng.choice((1, 4, 16)), rng.randint(4, 60), rng.choice(WATERMARKS)
    manager = BlockManager(num_blocks, bs, watermark=watermark, enable_prefix_caching=False)
    if rng.random() < 0.8:  # another sequence holds some blocks
        manager.allocate(Sequence(range(rng.randint(1, num_blocks * bs)), bs))
    free, kept = manager.num_free_blocks, int(watermark * num_blocks)
    # Most prompts sit right at a boundary: OK / LATER (free - kept) or LATER / NEVER (num_blocks - kept).
    needed = max(1, rng.choice((free - kept - 1, free - kept, free - kept + 1, num_blocks - kept,
                                num_blocks - kept + 1, rng.randint(1, num_blocks + 2))))
    num_tokens = (needed - 1) * bs + rng.randint(1, bs)
    expected = manager.can_allocate(Sequence(range(num_tokens), bs))
    why = _why(expected, num_tokens, bs, free, num_blocks, watermark)
    return Case(f"num_tokens={num_tokens}, block_size={bs}, num_free_blocks={free}, num_blocks={num_blocks}, "
                f"watermark={watermark}", lambda fn: fn(num_tokens, bs, free, num_blocks, watermark),
                lambda got: None if got is expected else f"expected {expected}, got {_show(got)}: {why}")


def _show(got) -> str:
    return str(got) if isinstance(got, AllocStatus) else f"{got!r} (return an AllocStatus)"


def _why(status, num_tokens, bs, free, num_blocks, watermark) -> str:
    needed, kept = -(-num_tokens // bs), int(watermark * num_blocks)
    prompt = (f"the prompt needs ceil({num_tokens} / {bs}) = {needed} blocks and the watermark keeps "
              f"int({watermark} x {num_blocks}) = {kept} free")
    if status is AllocStatus.NEVER:
        return f"{prompt}; {needed} > {num_blocks} - {kept}, so it can never be admitted"
    if status is AllocStatus.OK:
        return f"{prompt}; {free} - {needed} = {free - needed} stay free, which is >= {kept}"
    return (f"{prompt}; {free} - {needed} = {free - needed} would stay free, fewer than {kept}, but an emptier "
            f"pool could take it")
