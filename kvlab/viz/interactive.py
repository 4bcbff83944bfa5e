"""Sliders where a person is watching, one static run where nobody is.

A notebook cell runs in one of three ways: in a live frontend (Jupyter, JupyterLab, VS Code, Colab), executed
headless (nbconvert, nbclient, papermill, CI), or as plain Python. Widgets only make sense in the first:
executed headless they are saved as an empty widget view, so whoever reads the executed notebook sees
nothing. ``is_interactive()`` tells the cases apart; ``explore(fn, **knobs)`` gives ``fn`` sliders in a live
frontend and otherwise calls it once with its defaults, so the figure it draws is always there.
"""

import inspect
import os

from kvlab.errors import InvalidArgumentError

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


def _widget(name, spec, default):
    """A slider for ``(min, max, step)`` ints or floats, a dropdown for a list of options."""
    import ipywidgets as widgets

    if isinstance(spec, tuple) and len(spec) == 3 and all(isinstance(v, (int, float)) for v in spec):
        kind = widgets.IntSlider if all(isinstance(v, int) for v in spec) else widgets.FloatSlider
        return kind(value=default, min=spec[0], max=spec[1], step=spec[2], description=name,
                    continuous_update=False)  # rerun on release, not on every pixel of a drag
    return widgets.Dropdown(options=list(spec), value=default, description=name)


def explore(fn, **knobs):
    """Run ``fn`` with a widget per knob where someone is watching, else once with its default arguments.

    ``knobs`` maps parameter names of ``fn`` to ``(min, max, step)`` (a slider) or a list of choices (a
    dropdown). Each must be a parameter with a default, inside its range: the default starts the widget and is
    what a headless run uses. Returns the interactive widget, or ``fn()``'s result when run once."""
    params = inspect.signature(fn).parameters
    for name, spec in knobs.items():
        default = params[name].default if name in params else inspect.Parameter.empty
        if default is inspect.Parameter.empty:
            raise InvalidArgumentError(f"knob {name!r} must be a parameter of {fn.__name__} with a default")
        ranged = isinstance(spec, tuple) and len(spec) == 3 and all(isinstance(v, (int, float)) for v in spec)
        if (ranged and not spec[0] <= default <= spec[1]) or (not ranged and default not in list(spec)):
            raise InvalidArgumentError(f"knob {name!r}: the default {default!r} is not among {spec!r}")
    if is_interactive():
        import ipywidgets as widgets

        return widgets.interact(fn, **{name: _widget(name, spec, params[name].default) for name, spec in knobs.items()})
    print(f"(In Jupyter or Colab, widgets for {', '.join(knobs)} appear here; this run uses "
          + ", ".join(f"{name}={params[name].default!r}" for name in knobs) + ".)")
    return fn()
