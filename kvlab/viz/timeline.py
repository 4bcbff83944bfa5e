"""The manager's event log as a timeline: one row per event kind, one mark per event, in order.

``draw_timeline(manager_or_events)`` reads ``BlockManager(..., record_events=True).events``. Short logs
get a labelled mark per event (the block id, or the sequence for allocate/free/fork); long logs are
aggregated into a heatmap of event counts per kind and time bin, so 10^5 events stay readable.
"""

from collections import Counter

import matplotlib.pyplot as plt
import numpy as np

from kvlab.block_manager import BlockManager
from kvlab.records import Event
from kvlab.errors import InvalidArgumentError

#: Every kind the manager records, in the order a request meets them (top row first).
EVENT_KINDS = ("allocate", "hit", "miss", "append", "seal", "fork", "cow", "free", "release", "evict",
               "swap_out", "swap_in")
KIND_COLORS = dict(zip(EVENT_KINDS, ("#4e79a7", "#59a14f", "#e15759", "#76b7b2", "#9c755f", "#b07aa1",
                                     "#d1495b", "#4e79a7", "#bab0ac", "#f28e2b", "#59a89c", "#59a89c")))


def events_of(source) -> list:
    """The event list of a BlockManager (it must record events) or an iterable of Events, as a list."""
    if isinstance(source, BlockManager):
        if source.events is None:
            raise InvalidArgumentError("this manager records no events: create it with record_events=True")
        return list(source.events)
    events = list(source)
    for e in events:
        if not isinstance(e, Event):
            raise InvalidArgumentError(f"expected kvlab.Event objects, got {type(e).__name__}")
    return events


def event_label(e: Event) -> str:
    """Short text for one event: ``s3`` (a sequence), ``s3<s0`` (fork), ``2>5`` (copy src > dst), else the block."""
    if e.kind in ("allocate", "free"):
        return f"s{e.seq_id}"
    if e.kind == "fork":
        return f"s{e.seq_id}<s{e.other}"
    if e.kind == "cow":
        return f"{e.other}>{e.block_id}"
    if e.kind == "swap_out":
        return f"{e.block_id}>c{e.other}"
    if e.kind == "swap_in":
        return f"c{e.other}>{e.block_id}"
    return str(e.block_id)


def _kinds(events, kinds):
    """Rows to draw: the requested kinds, else the known kinds that occur (plus unknown ones, last)."""
    if kinds is not None:
        kinds = list(kinds)
        if not kinds or len(set(kinds)) != len(kinds):
            raise InvalidArgumentError(f"kinds must be a non-empty list of distinct kinds, got {kinds!r}")
        return kinds
    present = Counter(e.kind for e in events)
    return [k for k in EVENT_KINDS if k in present] + sorted(k for k in present if k not in EVENT_KINDS)


def draw_timeline(source, ax=None, *, kinds=None, max_marks: int = 300, bins: int = 100, title=None):
    """Draw the event log of ``source`` (a recording BlockManager or a list of Events); returns the Axes.

    ``kinds`` picks and orders the rows (default: the kinds that occur). Up to ``max_marks`` events are
    drawn one mark each (labelled while there are at most 80); more are counted in ``bins`` time bins."""
    events = events_of(source)
    if isinstance(max_marks, bool) or not isinstance(max_marks, int) or max_marks < 1:
        raise InvalidArgumentError(f"max_marks must be a positive int, got {max_marks!r}")
    rows = _kinds(events, kinds) or list(EVENT_KINDS)  # an empty log shows the empty rows
    row_of = {k: i for i, k in enumerate(rows)}
    shown = [(t, e) for t, e in enumerate(events) if e.kind in row_of]
    if ax is None:
        _, ax = plt.subplots(figsize=(10 if len(shown) > 30 else 7, 0.35 * len(rows) + 1.2))
    if len(shown) > max_marks:
        _draw_counts(ax, shown, row_of, len(events), bins)
    else:
        for kind in rows:
            xs = [t for t, e in shown if e.kind == kind]
            ax.scatter(xs, [row_of[kind]] * len(xs), s=40, marker="s", color=KIND_COLORS.get(kind, "#666666"),
                       gid=f"events-{kind}", zorder=2)
        if len(shown) <= 80:
            for k, (t, e) in enumerate(shown):  # alternate above/below so neighbours' labels do not overlap
                ax.annotate(event_label(e), (t, row_of[e.kind]), xytext=(0, 6 if k % 2 == 0 else -11),
                            textcoords="offset points", ha="center", fontsize=6.5, gid=f"event-{t}")
        ax.set_xlim(-1, max(len(events), 1))
        ax.grid(axis="x", alpha=0.3)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.7)  # first kind on top
    ax.set_xlabel("event number (order in which the manager recorded them)", fontsize=8)
    ax.set_title(title if title is not None else f"{len(events)} events", fontsize=10)
    return ax


def _draw_counts(ax, shown, row_of, num_events, bins):
    """Heatmap of how many events of each kind fall in each of ``bins`` equal slices of the log."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise InvalidArgumentError(f"bins must be a positive int, got {bins!r}")
    counts = np.zeros((len(row_of), bins))
    times = np.array([t for t, _ in shown])
    kinds = np.array([row_of[e.kind] for _, e in shown])
    np.add.at(counts, (kinds, np.minimum(times * bins // max(num_events, 1), bins - 1)), 1)
    image = ax.imshow(np.ma.masked_equal(counts, 0), aspect="auto", cmap="viridis", interpolation="nearest",
                      extent=(0, num_events, len(row_of) - 0.5, -0.5), gid="events-heatmap")
    ax.figure.colorbar(image, ax=ax, label=f"events per bin ({num_events / bins:.0f} events wide)", pad=0.01)
