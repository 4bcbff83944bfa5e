"""The knobs of ``explore``: what a student may turn, checked before any widget exists.

A knob is ``(min, max, step)`` (a slider), a list of choices (a dropdown), or ``Stops(values)`` (a slider that
stops only at those values, e.g. log-spaced pool sizes). Its default (the function parameter's) must be a value
the widget can show and return to: a ``(min, max, step)`` slider whose default is off its step grid stops at the
grid values plus the default, so that dragging can always bring it back.
"""

import inspect
import math
from numbers import Real

from kvlab.errors import InvalidArgumentError

KNOB_KINDS = "(min, max, step), a list of choices, or viz.Stops(values)"
#: A slider with more stops than this cannot be set by dragging anyway (and would be slow to build).
MAX_STOPS = 1000


def _label(value) -> str:
    """Ints with thousands separators, floats in their shortest form."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _plain(value):
    """numpy scalars as Python numbers, so that widgets, labels and equality behave."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (str, bytes)) else value


class Stops:
    """A slider knob over ``values``, in the order given (at least two, no repeats): every value, the default
    among them, is a stop that dragging reaches, however far apart they are (``np.geomspace`` for sizes)."""

    def __init__(self, values):
        values = tuple(_plain(v) for v in values)
        try:
            distinct = len(set(values))
        except TypeError:
            raise InvalidArgumentError(f"Stops needs hashable values (numbers, strings), got {values!r}") from None
        if len(values) < 2 or distinct != len(values) or len(values) > MAX_STOPS:
            raise InvalidArgumentError(f"Stops needs 2 to {MAX_STOPS} distinct values, got {len(values)}: "
                                       f"{values[:8]!r}")
        self.values = values

    def __repr__(self) -> str:
        return f"Stops({list(self.values)!r})"

    def labels(self) -> list[tuple[str, object]]:
        """(label, value) pairs, as a SelectionSlider takes its options."""
        return [(_label(v), v) for v in self.values]


def _is_range(spec) -> bool:
    return (isinstance(spec, tuple) and len(spec) == 3
            and all(isinstance(v, Real) and not isinstance(v, bool) for v in spec))


def _grid_with(spec, default) -> Stops | None:
    """None when ``default`` lies on ``min + k * step``; else Stops over that grid with the default inserted."""
    low, high, step = spec
    k = (default - low) / step
    if math.isclose(k, round(k), abs_tol=1e-9):
        return None
    count = int(math.floor((high - low) / step + 1e-9)) + 1
    if count >= MAX_STOPS:
        raise InvalidArgumentError(f"the default {default!r} is off the grid of {spec!r} ({count} steps): give a "
                                   "default on it, or use viz.Stops(values)")
    ints = all(isinstance(v, int) for v in spec)
    grid = [low + i * step if ints else round(low + i * step, 12) for i in range(count)]
    return Stops(sorted(set(grid) | {default}))


def check_knob(fn, name: str, spec, params) -> object:
    """The validated knob for parameter ``name`` of ``fn`` (``params``: its signature's parameters): ``spec``
    itself, or Stops for a ``(min, max, step)`` whose default is off the grid. Raises InvalidArgumentError."""
    default = params[name].default if name in params else inspect.Parameter.empty
    if default is inspect.Parameter.empty:
        raise InvalidArgumentError(f"knob {name!r} must be a parameter of {fn.__name__} with a default")
    if isinstance(spec, Stops):
        if default not in spec.values:
            raise InvalidArgumentError(f"knob {name!r}: the default {default!r} is not among {spec!r}")
        return spec
    if _is_range(spec):
        low, high, step = spec
        if not (low < high and step > 0):
            raise InvalidArgumentError(f"knob {name!r}: (min, max, step) needs min < max and step > 0, got {spec!r}")
        if not low <= default <= high:
            raise InvalidArgumentError(f"knob {name!r}: the default {default!r} is not among {spec!r}")
        return _grid_with(spec, default) or spec
    if isinstance(spec, list):
        if default not in spec:
            raise InvalidArgumentError(f"knob {name!r}: the default {default!r} is not among {spec!r}")
        return spec
    raise InvalidArgumentError(f"knob {name!r} must be {KNOB_KINDS}, got {spec!r}")


def knob_widget(name: str, spec, default):
    """The widget for a checked knob, starting at ``default``; each reruns on release, not on every pixel."""
    import ipywidgets as widgets

    if isinstance(spec, Stops):
        return widgets.SelectionSlider(options=spec.labels(), value=_plain(default), description=name,
                                       continuous_update=False)
    if _is_range(spec):
        kind = widgets.IntSlider if all(isinstance(v, int) for v in spec) else widgets.FloatSlider
        return kind(value=default, min=spec[0], max=spec[1], step=spec[2], description=name,
                    continuous_update=False)
    return widgets.Dropdown(options=list(spec), value=default, description=name)
