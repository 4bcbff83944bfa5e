"""Step through recorded snapshots: a slider widget in a live Jupyter session, a static grid elsewhere.

Record with ``steps.append(snapshot(manager, seqs, "after allocate"))`` after each operation, then call
``show_steps(steps)``. The grid is the default wherever a widget would not render (GitHub's notebook
viewer, CI, nbconvert), so a notebook always shows every step.
"""

import os

import matplotlib.pyplot as plt

from kvlab.errors import InvalidArgumentError
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


def snapshot_grid(views, *, ncols: int = 2, draw=draw_block_tables, panel_size=None):
    """All snapshots side by side, ``ncols`` per row, each titled ``"step i: label"``; returns the Figure.
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
            draw(views[i], ax=ax, title=f"step {i}: {views[i].label}")
        else:
            ax.axis("off")
    fig.tight_layout()
    return fig


def widgets_available() -> bool:
    """True inside a live Jupyter kernel with ipywidgets installed and not under CI (``KVLAB_CI``/``CI``)."""
    if os.environ.get("KVLAB_CI") or os.environ.get("CI"):
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def step_widget(views, *, draw=draw_block_tables, figsize=(9, 3.6)):
    """A slider over the snapshots that redraws one at a time (needs ipywidgets); returns the widget."""
    import ipywidgets as widgets
    from IPython.display import display

    views = _check_views(views)
    slider = widgets.IntSlider(value=0, min=0, max=len(views) - 1, description="step", continuous_update=False)
    out = widgets.Output()

    def render(change=None):
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=figsize)
            draw(views[slider.value], ax=ax, title=f"step {slider.value}: {views[slider.value].label}")
            display(fig)
            plt.close(fig)

    slider.observe(render, names="value")
    render()
    return widgets.VBox([slider, out])


def show_steps(views, *, interactive=None, **kwargs):
    """Where widgets work (or with ``interactive=True``): display a ``step_widget`` and return it. Else
    return ``snapshot_grid``'s Figure (pyplot shows it at the end of the cell). ``kwargs`` go to
    ``snapshot_grid`` (``ncols``, ``draw``, ``panel_size``) or ``step_widget`` (``draw``, ``figsize``)."""
    if interactive is None:
        interactive = widgets_available()
    if interactive:
        from IPython.display import display

        widget = step_widget(views, **{k: v for k, v in kwargs.items() if k in ("draw", "figsize")})
        display(widget)
        return widget
    return snapshot_grid(views, **{k: v for k, v in kwargs.items() if k in ("ncols", "draw", "panel_size")})
