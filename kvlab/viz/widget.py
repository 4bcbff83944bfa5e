"""Step through recorded snapshots: a slider widget in a live Jupyter session, a static grid elsewhere.

Record with ``steps.append(snapshot(manager, seqs, "after allocate"))`` after each operation, then call
``show_steps(steps)``. The grid is the default wherever a widget would not render (executed headless by
nbconvert or nbclient, in CI, GitHub's notebook viewer), so a notebook always shows every snapshot.
"""

import matplotlib.pyplot as plt

from kvlab.errors import InvalidArgumentError
from kvlab.viz.interactive import explore_live, is_interactive
from kvlab.viz.pool import draw_block_tables
from kvlab.viz.snapshot import PoolView


def _check_views(views) -> list:
    views = list(views)
    if not views:
        raise InvalidArgumentError("no snapshots to show: record some with kvlab.viz.snapshot(manager, seqs, label)")
    for v in views:
        if not isinstance(v, PoolView):
            raise InvalidArgumentError(f"expected PoolView snapshots, got {type(v).__name__}")
    return views


def _panel_size(views) -> tuple[float, float]:
    """Width and height of one panel: block-table drawings are as tall as their number of rows."""
    rows = max(len(v.tables) for v in views) + (1.2 if any(v.cpu_refs for v in views) else 0)
    return 6.5, 0.5 * (2.2 + 1.3 * rows) + 0.4


def panel_title(i: int, view: PoolView) -> str:
    """``"(i) label"``: the snapshot's number (the widget's slider value) and what it shows."""
    return f"({i}) {view.label}" if view.label else f"({i})"


def snapshot_grid(views, *, ncols: int = 2, draw=draw_block_tables, panel_size=None):
    """All snapshots side by side, ``ncols`` per row, each titled ``"(i) label"``; returns the Figure.
    ``panel_size`` (inches) defaults to what a block-table drawing of these snapshots needs."""
    views = _check_views(views)
    panel_size = panel_size or _panel_size(views)
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise InvalidArgumentError(f"ncols must be a positive int, got {ncols!r}")
    ncols = min(ncols, len(views))
    nrows = -(-len(views) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(views):
            draw(views[i], ax=ax, title=panel_title(i, views[i]))
        else:
            ax.axis("off")
    fig.tight_layout()
    return fig


def step_widget(views, *, draw=draw_block_tables, figsize=(9, 3.6)):
    """Display a slider over the snapshots that redraws one at a time (needs ipywidgets), the figure kept as an
    ordinary output as ``explore`` keeps it (a saved notebook shows the last one); returns the slider's box."""
    views = _check_views(views)

    def show_snapshot(snapshot=0):
        fig, ax = plt.subplots(figsize=figsize)
        draw(views[snapshot], ax=ax, title=panel_title(snapshot, views[snapshot]))
        plt.show()

    return explore_live(show_snapshot, snapshot=(0, len(views) - 1, 1) if len(views) > 1 else [0])


def show_steps(views, *, interactive=None, **kwargs):
    """In a live frontend (``is_interactive()``, or ``interactive=True``): display a ``step_widget`` and return
    it. Else return ``snapshot_grid``'s Figure (``plt.show()`` or the end of the cell shows it). ``kwargs`` go to
    ``snapshot_grid`` (``ncols``, ``draw``, ``panel_size``) or ``step_widget`` (``draw``, ``figsize``)."""
    if interactive is None:
        interactive = is_interactive()
    if interactive:
        return step_widget(views, **{k: v for k, v in kwargs.items() if k in ("draw", "figsize")})
    return snapshot_grid(views, **{k: v for k, v in kwargs.items() if k in ("ncols", "draw", "panel_size")})
