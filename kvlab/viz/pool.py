"""Pictures of the GPU pool and of the block tables that point into it.

``draw_pool``: every block as a box coloured by state (free, warm, used, shared, null), with its id and
either its ref count (used) or its place in the reuse order (free: #0 is reused next). A pool larger than
``max_boxes`` is drawn as a heatmap of states instead (one pixel per block), so a 10k-block pool stays
legible. ``draw_block_tables``: one row per sequence (logical blocks left to right, each cell filled in
proportion to the tokens it holds) with arrows to the physical blocks, the pool underneath and, when some
sequence is swapped out, the CPU blocks it uses. A hybrid manager's sequence gets one row per KV cache group,
labelled with the group ("seq 3 · window 8"), in its sequence's colour; entries a window released show as null.

Artists carry gids (``pool-<id>``, ``table-<seq>-<i>``, ``cpu-<id>``, ``arrow-<seq>-<i>``; a group's row is
``<seq>g<group>``: ``table-3g1-0``) so tests and curious readers can find what was drawn for a given block.
"""

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Circle, Patch, Rectangle

from kvlab.errors import InvalidArgumentError
from kvlab.viz.snapshot import (CPU_COLOR, FREE, NULL, SHARED, STATE_COLORS, STATE_NAMES, USED, WARM,
                                PoolView, as_view)

PAD = 0.06          # gap around a box, in box widths
TEXT_DARK = "#1b1b1b"
SEQ_COLORS = plt.get_cmap("tab10").colors


def _axes(ax, width, height):
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16, max(5.0, 0.5 * width + 1.5)), min(12, max(1.6, 0.55 * height + 0.8))))
    return ax


def _box(ax, x, y, color, gid, *, edge="#555555", linewidth=0.8):
    rect = Rectangle((x + PAD, y + PAD), 1 - 2 * PAD, 1 - 2 * PAD, facecolor=color, edgecolor=edge,
                     linewidth=linewidth, gid=gid)
    ax.add_patch(rect)
    return rect


def _text_color(state) -> str:
    return "white" if state in (USED, SHARED, NULL) else TEXT_DARK


def _legend(ax, view: PoolView, extra=(), **kwargs):
    handles = [Patch(facecolor=STATE_COLORS[s], edgecolor="#555555", label=f"{STATE_NAMES[s]}: {view.count(s)}")
               for s in (USED, SHARED, WARM, FREE, NULL) if view.count(s) or s in (USED, FREE)]
    handles += list(extra)
    ax.legend(handles=handles, fontsize=8, frameon=False, **kwargs)


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


def draw_pool(pool, seqs=(), ax=None, *, max_boxes: int = 256, title=None):
    """Draw the GPU pool of ``pool`` (a BlockManager or HybridBlockManager, or a PoolView from ``snapshot``);
    returns the Axes. Boxes up to ``max_boxes`` blocks, a state heatmap above."""
    _check_positive("max_boxes", max_boxes)
    view = as_view(pool, seqs)
    if view.num_blocks > max_boxes:
        return _draw_heatmap(view, ax, title)
    n = view.num_blocks
    cols = n if n <= 16 else 16 if n <= 64 else 32
    rows = -(-n // cols)
    ax = _axes(ax, cols, rows + 1)
    small = n > 64
    for b in range(n):
        state, x, y = int(view.states[b]), b % cols, -(b // cols)
        shared = state == SHARED
        _box(ax, x, y, STATE_COLORS[state], f"pool-{b}", edge="black" if shared else "#555555",
             linewidth=2.0 if shared else 0.8)
        ax.text(x + 0.5, y + (0.5 if small else 0.62), str(b), ha="center", va="center",
                fontsize=6 if small else 9, color=_text_color(state), gid=f"pool-id-{b}")
        if not small:
            if state in (USED, SHARED):
                sub = f"ref {view.refs[b]}"
            elif state == NULL:
                sub = "null"
            else:
                sub = f"#{view.reuse_rank[b]}"
            ax.text(x + 0.5, y + 0.3, sub, ha="center", va="center", fontsize=7, color=_text_color(state),
                    gid=f"pool-sub-{b}")
        if view.cached[b]:  # hittable by a prefix lookup (in use, or warm)
            ax.add_patch(Circle((x + 1 - 2.2 * PAD, y + 1 - 2.2 * PAD), 0.07, facecolor="#ffd92f",
                                edgecolor=TEXT_DARK, linewidth=0.5, gid=f"cached-{b}"))
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(-rows + 0.9, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    dot = Circle((0, 0), 0.1, facecolor="#ffd92f", edgecolor=TEXT_DARK, label="cached (a prefix lookup can hit it)")
    _legend(ax, view, [dot], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title if title is not None else (view.label or f"pool: {view.summary()}"), fontsize=10)
    return ax


def _draw_heatmap(view: PoolView, ax, title):
    """One cell per block, row-major: block id = row * cols + col. Cells past the last block are blank."""
    n = view.num_blocks
    cols = math.ceil(math.sqrt(n * 2))  # twice as wide as tall: fits a notebook cell
    rows = -(-n // cols)
    grid = np.full(rows * cols, np.nan)
    grid[:n] = view.states
    if ax is None:
        _, ax = plt.subplots(figsize=(9, max(2.5, 9 * rows / cols + 0.8)))
    cmap = ListedColormap(STATE_COLORS).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(grid.reshape(rows, cols)), cmap=cmap, vmin=-0.5, vmax=len(STATE_COLORS) - 0.5,
              interpolation="nearest", aspect="equal", gid="pool-heatmap")
    ax.set_xticks([])
    step = max(1, rows // 6)
    ax.set_yticks(range(0, rows, step), [str(r * cols) for r in range(0, rows, step)], fontsize=7)
    ax.set_ylabel(f"first block id of the row ({cols} per row)", fontsize=8)
    _legend(ax, view, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title if title is not None else (view.label or f"{n} blocks: {view.summary()}"), fontsize=10)
    return ax


def _pool_columns(view: PoolView, max_pool_boxes: int) -> tuple[dict, bool]:
    """Block id -> x position for the pool row under the tables: every block if the pool is small, else
    only the blocks some GPU table uses (and the null block), in id order."""
    if view.num_blocks <= max_pool_boxes:
        return {b: b for b in range(view.num_blocks)}, False
    used = {b for t in view.tables if not t.on_cpu for b in t.blocks}
    used |= {b for b in range(view.num_blocks) if view.states[b] == NULL}
    return {b: x for x, b in enumerate(sorted(used))}, True


def draw_block_tables(pool, seqs=(), ax=None, *, names=None, max_pool_boxes: int = 24, max_cells: int = 40,
                      arrows=None, title=None, pool_label: str = "GPU pool", swap_label: str = "CPU pool"):
    """Draw each sequence's block table above the pool, with arrows from logical to physical blocks.

    ``pool`` is a BlockManager or HybridBlockManager (then ``seqs`` says whose tables to draw, a row per
    group in a hybrid one, and ``names`` what to call them: a list parallel to ``seqs`` or a dict from sequence
    id to name) or a PoolView. A pool of more than ``max_pool_boxes`` blocks shows only the blocks the tables
    use. Swapped-out sequences are drawn on top, under the CPU blocks they point at. ``arrows`` defaults to on
    while there are at most 48 table entries. Tables longer than ``max_cells`` are drawn compactly instead (one
    coloured cell per logical block, no pool row). ``pool_label`` and ``swap_label`` name the two pools where
    they live somewhere else (an engine on a CPU keeps its KV pool in host memory). Returns the Axes."""
    for name, label in (("pool_label", pool_label), ("swap_label", swap_label)):
        if not isinstance(label, str):
            raise InvalidArgumentError(f"{name} must be a str, got {label!r}")
    _check_positive("max_pool_boxes", max_pool_boxes)
    _check_positive("max_cells", max_cells)
    view = as_view(pool, seqs, names)
    if max((len(t.blocks) for t in view.tables), default=0) > max_cells:
        return _draw_compact_tables(view, ax, title)
    # Swapped tables go on top, next to the CPU row they point up to; GPU tables below, next to the pool.
    tables = [t for t in view.tables if t.on_cpu] + [t for t in view.tables if not t.on_cpu]
    # One colour per sequence (a hybrid manager's group rows share their sequence's): its first row's order.
    firsts = [t for t in view.tables if t.group in (None, 0)]
    color_of = {t.seq_id: SEQ_COLORS[k % len(SEQ_COLORS)] for k, t in enumerate(firsts)}
    columns, compressed = _pool_columns(view, max_pool_boxes)
    cpu_blocks = sorted(view.cpu_refs)
    cpu_x = {c: x for x, c in enumerate(cpu_blocks)}
    width = max([len(columns), len(cpu_blocks)] + [len(t.blocks) for t in tables] + [1])
    if arrows is None:
        arrows = sum(len(t.blocks) for t in tables) <= 48
    row_y = {t.key: 2.0 + 1.3 * (len(tables) - 1 - k) for k, t in enumerate(tables)}
    top = 2.0 + 1.3 * len(tables)
    cpu_y = top + 0.4
    if cpu_blocks:
        top = cpu_y + 1.2
    ax = _axes(ax, width + 4, top + 1)
    bs = view.block_size

    for b, x in columns.items():  # the GPU pool row
        state = int(view.states[b])
        _box(ax, x, 0, STATE_COLORS[state], f"pool-{b}", edge="black" if state == SHARED else "#555555",
             linewidth=2.0 if state == SHARED else 0.8)
        ax.text(x + 0.5, 0.5, "∅" if state == NULL else str(b), ha="center", va="center", fontsize=8,
                color=_text_color(state))
    ax.text(-0.3, 0.5, pool_label + (f"\n({len(columns)} of {view.num_blocks})" if compressed else ""),
            ha="right", va="center", fontsize=8)
    for c, x in cpu_x.items():  # CPU blocks of swapped sequences
        _box(ax, x, cpu_y, CPU_COLOR, f"cpu-{c}", edge="black" if view.cpu_refs[c] > 1 else "#555555",
             linewidth=2.0 if view.cpu_refs[c] > 1 else 0.8)
        ax.text(x + 0.5, cpu_y + 0.5, f"c{c}", ha="center", va="center", fontsize=8, color="white")
    if cpu_blocks:
        ax.text(-0.3, cpu_y + 0.5, f"{swap_label}\n({view.num_free_cpu_blocks} free)", ha="right", va="center",
                fontsize=8)

    for table in tables:
        y, color = row_y[table.key], color_of[table.seq_id]
        ax.text(-0.3, y + 0.5, f"{table.display_name}\n{table.status}, {table.num_tokens} tok", ha="right",
                va="center", fontsize=8, color=color)
        for i, block in enumerate(table.blocks):
            released = i < table.num_released
            fill_color, label = _cell_look(view, table, i, block)
            _box(ax, i, y, "white", f"table-{table.key}-{i}", edge=color, linewidth=1.2)
            size = table.block_size or bs
            fill = table.tokens_in(i, size) / size
            ax.add_patch(Rectangle((i + PAD, y + PAD), (1 - 2 * PAD) * fill, 1 - 2 * PAD, facecolor=fill_color,
                                   edgecolor="none", gid=f"fill-{table.key}-{i}"))
            dark = fill > 0.5 and fill_color != STATE_COLORS[WARM]
            ax.text(i + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8,
                    color="white" if dark else TEXT_DARK, gid=f"table-label-{table.key}-{i}")
            if not arrows or released:
                continue
            start, end = ((i + 0.5, y + 1 - PAD), (cpu_x[block] + 0.5, cpu_y + PAD)) if table.on_cpu else \
                ((i + 0.5, y + PAD), (columns[block] + 0.5, 1 - PAD))
            ax.annotate("", xy=end, xytext=start, gid=f"arrow-{table.key}-{i}", zorder=0.5,
                        arrowprops=dict(arrowstyle="-|>", mutation_scale=7, color=color, alpha=0.55, linewidth=0.9,
                                        shrinkA=0, shrinkB=0))
    ax.set_xlim(-3.2, width + 0.2)
    ax.set_ylim(-0.2, top)
    ax.set_aspect("equal")
    ax.axis("off")
    _legend(ax, view, [Patch(facecolor=CPU_COLOR, label="CPU block (swapped out)")] if cpu_blocks else [],
            loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title if title is not None else (view.label or f"block tables (block size {bs})"), fontsize=10)
    return ax


def _cell_look(view: PoolView, table, i: int, block: int) -> tuple[str, str]:
    """(colour, label) of table entry ``i``: the null block, a CPU block, or the GPU block's state."""
    if i < table.num_released:
        return STATE_COLORS[NULL], "∅"
    if table.on_cpu:
        return CPU_COLOR, f"c{block}"
    return STATE_COLORS[int(view.states[block])], str(block)


def _draw_compact_tables(view: PoolView, ax, title):
    """Long tables: one row per sequence, one cell per logical block, coloured like the block it maps to."""
    tables = view.tables
    width = max(len(t.blocks) for t in tables)
    palette = list(STATE_COLORS) + [CPU_COLOR]
    grid = np.full((len(tables), width), np.nan)
    for r, table in enumerate(tables):
        for i, block in enumerate(table.blocks):
            color, _ = _cell_look(view, table, i, block)
            grid[r, i] = palette.index(color)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.4 * len(tables) + 1.2))
    cmap = ListedColormap(palette).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=-0.5, vmax=len(palette) - 0.5, aspect="auto",
              interpolation="nearest", gid="tables-heatmap")
    ax.set_yticks(range(len(tables)), [f"{t.display_name} ({t.status}, {t.num_tokens} tok)" for t in tables],
                  fontsize=8)
    ax.set_xlabel("logical block index", fontsize=8)
    extra = [Patch(facecolor=CPU_COLOR, label="CPU block (swapped out)")] if view.cpu_refs else []
    _legend(ax, view, extra, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title if title is not None else
                 (view.label or f"block tables (block size {view.block_size}): colour = state of the physical block"),
                 fontsize=10)
    return ax
