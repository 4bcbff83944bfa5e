"""A sequence's tokens split into logical blocks: the picture before any physical block is involved.

``draw_tokens(seqs)`` draws one row per sequence, one cell per token slot, blocks separated by a gap; the
empty slots of a partial last block are dashed. Optional per-block colours and captions (e.g. each
block's hash, or "hit"/"miss") make the same picture explain prefix caching.
"""

import matplotlib.pyplot as plt

from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError
from kvlab.viz.pool import SEQ_COLORS

GAP = 0.5            # space between logical blocks, in slot widths
PLAIN = "#dbe6f1"    # block colour when none is given
MAX_SLOTS = 160      # beyond this many slots in one row, token ids are no longer written in the cells


def _block_x(i: int, block_size: int) -> float:
    return i * (block_size + GAP)


def draw_tokens(seqs, ax=None, *, block_colors=None, captions=None, names=None, title=None):
    """Draw the tokens of ``seqs`` (a Sequence or a list) in their logical blocks; returns the Axes.

    ``block_colors`` / ``captions``: dicts from a sequence's position in ``seqs`` to a list with one colour
    / one short string per logical block. ``names``: row labels (default ``seq <id>``)."""
    seqs = [seqs] if isinstance(seqs, Sequence) else list(seqs)
    if not seqs or not all(isinstance(s, Sequence) for s in seqs):
        raise InvalidArgumentError("draw_tokens needs one or more kvlab.Sequence objects")
    block_colors, captions = block_colors or {}, captions or {}
    names = list(names) if names is not None else [f"seq {s.seq_id}" for s in seqs]
    if len(names) != len(seqs):
        raise InvalidArgumentError(f"{len(names)} names for {len(seqs)} sequences")
    for what, per_seq in (("block_colors", block_colors), ("captions", captions)):
        for k, values in per_seq.items():
            if not 0 <= k < len(seqs) or len(values) != seqs[k].num_blocks:
                raise InvalidArgumentError(f"{what}[{k}] needs one entry per logical block of seqs[{k}]")
    widest = max(_block_x(s.num_blocks, s.block_size) for s in seqs)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16, 0.32 * widest + 2), 0.75 * len(seqs) + 0.6))
    row_height = 1.9 if captions else 1.4
    for r, seq in enumerate(seqs):
        y, bs = -r * row_height, seq.block_size
        tokens = seq.token_ids
        write_ids = seq.num_blocks * bs <= MAX_SLOTS
        ax.text(-0.6, y + 0.5, names[r], ha="right", va="center", fontsize=9, color=SEQ_COLORS[r % len(SEQ_COLORS)])
        for i in range(seq.num_blocks):
            x0 = _block_x(i, bs)
            color = block_colors.get(r, [PLAIN] * seq.num_blocks)[i]
            for j in range(bs):
                position = i * bs + j
                filled = position < len(tokens)
                ax.add_patch(plt.Rectangle((x0 + j, y), 1, 1, facecolor=color if filled else "white",
                                           edgecolor="#444444" if filled else "#999999", linewidth=0.7,
                                           linestyle="-" if filled else "--", gid=f"slot-{r}-{position}"))
                if filled and write_ids:
                    ax.text(x0 + j + 0.5, y + 0.5, str(tokens[position]), ha="center", va="center", fontsize=7,
                            gid=f"token-{r}-{position}")
            if r in captions:
                ax.text(x0 + bs / 2, y + 1.15, captions[r][i], ha="center", va="bottom", fontsize=7,
                        gid=f"caption-{r}-{i}")
    ax.set_xlim(-0.3, widest)
    ax.set_ylim(-(len(seqs) - 1) * row_height - 0.3, 1.3 + (0.5 if captions else 0))
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    return ax
