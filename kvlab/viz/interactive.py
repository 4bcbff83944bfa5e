"""Sliders where a person is watching, one static run where nobody is.

A notebook cell runs in one of three ways: in a live frontend (Jupyter, JupyterLab, VS Code, Colab), executed
headless (nbconvert, nbclient, papermill, CI), or as plain Python. Widgets only make sense in the first:
executed headless they are saved as an empty widget view, so whoever reads the executed notebook sees
nothing. ``is_interactive()`` tells the cases apart; ``explore(fn, **knobs)`` gives ``fn`` sliders in a live
frontend and otherwise calls it once with its defaults, so the figure it draws is always there.

Widgets live in the kernel: a saved notebook reopened with a new kernel (or shared) shows "Error displaying
widget: model not found" where they were. So in a live frontend the figures are not drawn inside a widget but
as ordinary outputs that each redraw replaces in place: the notebook file keeps the last figure, and a note
says how to bring the sliders back (run the cell).
"""

import inspect
import os

from kvlab.viz.knobs import check_knob, knob_widget

#: Set by kvlab's notebook tests and by most CI services: never interactive, whatever the kernel says.
STATIC_ENV = ("KVLAB_CI", "CI")


def is_interactive() -> bool:
    """True in a live Jupyter or Colab frontend with ipywidgets installed.

    False outside IPython, without ipywidgets, when ``KVLAB_CI`` or ``CI`` is set, and whenever the cell was
    sent by a headless runner: ipykernel records per execution whether the frontend can answer ``input()``;
    nbclient (hence nbconvert and papermill) always says it cannot, a person's frontend says it can."""
    if any(os.environ.get(var) for var in STATIC_ENV):
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    return bool(getattr(kernel, "_allow_stdin", False))


#: Printed under the sliders of a live explore: saved notebooks keep the figure, not the widgets.
REOPENED_NOTE = ("(Move the sliders to redraw. The figure below is saved with the notebook; in a reopened or "
                 "shared copy the sliders read 'Error displaying widget' or are missing: Run > Run All Cells brings "
                 "them back (this cell alone would miss the cells before it in a new kernel).)")


def _draw(fn, kwargs) -> list[tuple[dict, dict]]:
    """Run ``fn(**kwargs)`` and return what it showed, as (data, metadata) bundles: its figures (shown by
    ``plt.show()``, or left open), then its printed text."""
    import matplotlib.pyplot as plt
    from IPython.display import display
    from IPython.utils.capture import capture_output

    before = set(plt.get_fignums())
    with capture_output() as captured:
        fn(**kwargs)
        for num in sorted(set(plt.get_fignums()) - before):  # figures fn left open: show them, as a cell would
            display(plt.figure(num))
            plt.close(num)
    bundles = [(out.data, out.metadata or {}) for out in captured.outputs]
    return bundles + ([({"text/plain": captured.stdout}, {})] if captured.stdout else [])


def explore_live(fn, **knobs):
    """``explore``'s live branch, for callers that decide themselves (``show_steps(interactive=True)``): display
    the widgets, then what ``fn`` shows as ordinary outputs that each redraw updates in place (by display id), so
    the notebook file keeps the last figure; return the widgets' box."""
    import ipywidgets as widgets
    from IPython.display import DisplayHandle, display

    params = inspect.signature(fn).parameters
    knobs = {name: check_knob(fn, name, spec, params) for name, spec in knobs.items()}
    controls = {name: knob_widget(name, spec, params[name].default) for name, spec in knobs.items()}
    # Under the sliders, live only: an error while redrawing, and what a redraw shows beyond the first's outputs.
    overflow = widgets.Output()
    box = widgets.VBox([*controls.values(), overflow])
    display(box)
    print(REOPENED_NOTE)
    first = _draw(fn, {})
    slots = [DisplayHandle() for _ in first]
    for slot, (data, metadata) in zip(slots, first):
        slot.display(data, metadata=metadata, raw=True)

    def redraw(change=None):
        overflow.clear_output()
        bundles = None
        with overflow:  # an error in fn shows here, as a cell's would, not only in the kernel's log
            bundles = _draw(fn, {name: widget.value for name, widget in controls.items()})
        if bundles is None:
            return
        for i, slot in enumerate(slots):
            data, metadata = bundles[i] if i < len(bundles) else ({"text/plain": ""}, {})
            slot.update(data, metadata=metadata, raw=True)
        with overflow:
            for data, metadata in bundles[len(slots):]:
                display(data, metadata=metadata, raw=True)

    for widget in controls.values():
        widget.observe(redraw, names="value")
    # explore has shown the box already: as the cell's last value it must not appear a second time (an Out[n]).
    box._ipython_display_ = lambda **kwargs: None
    return box


def explore(fn, **knobs):
    """Run ``fn`` with a widget per knob where someone is watching, else once with its default arguments.

    ``knobs`` maps parameter names of ``fn`` to ``(min, max, step)`` (a slider), a list of choices (a
    dropdown) or ``Stops(values)`` (a slider over those values only). Each must be a parameter with a default
    the widget can show: the default starts the widget and is what a headless run uses. Live, the figures ``fn``
    shows are ordinary outputs redrawn in place, so a saved notebook keeps the last one; returns the widget
    (already shown). Headless, returns ``fn()``'s result."""
    if is_interactive():
        return explore_live(fn, **knobs)
    params = inspect.signature(fn).parameters
    knobs = {name: check_knob(fn, name, spec, params) for name, spec in knobs.items()}
    print(f"(In Jupyter or Colab, widgets for {', '.join(knobs)} appear here; this run uses "
          + ", ".join(f"{name}={params[name].default!r}" for name in knobs) + ".)")
    return fn()
