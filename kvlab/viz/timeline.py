"""The manager's event log as a timeline: one row per event kind, one mark per event, in order.

``draw_timeline(manager_or_events)`` reads ``BlockManager(..., record_events=True).events``. Short logs
get a labelled mark per event (the block id, or the sequence for allocate/free/fork, by the notebook's
``names``); ``phases`` shade and caption the stretches of the log that one operation produced ("X freed"),
so the reader sees which call caused which events. Long logs are aggregated into a heatmap of event counts
per kind and time bin, so 10^5 events stay readable.
"""

from collections import Counter

import matplotlib.pyplot as plt
import numpy as np

from kvlab.blocks.manager import BlockManager
from kvlab.blocks.records import Event
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


#: What a mark's label means, per kind (printed under the timeline for the kinds it shows).
LABEL_MEANING = {"allocate": "sequence", "free": "sequence", "fork": "child<parent", "cow": "copied block>new block",
                 "swap_out": "GPU block>CPU block", "swap_in": "CPU block>GPU block"}


def event_label(e: Event, names=None) -> str:
    """Short text for one event: the sequence (``names[seq_id]``, else ``s3``) for allocate/free, ``B<A`` for a
    fork, ``2>5`` for a copy (src > dst), ``4>c1`` / ``c1>7`` for swaps and the offload tier's offloads and
    promotions (c: a CPU block or tier slot), ``c3`` for a tier slot dropped, else the block id."""
    def seq(seq_id):
        return str(names[seq_id]) if names and seq_id in names else f"s{seq_id}"

    if e.kind in ("allocate", "free"):
        return seq(e.seq_id)
    if e.kind == "fork":
        return f"{seq(e.seq_id)}<{seq(e.other)}"
    if e.kind == "cow":
        return f"{e.other}>{e.block_id}"
    if e.kind in ("swap_out", "offload"):
        return f"{e.block_id}>c{e.other}"
    if e.kind in ("swap_in", "promote"):
        return f"c{e.other}>{e.block_id}"
    if e.kind == "tier_evict":
        return f"c{e.other}"
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


def label_key(kinds) -> str:
    """What the marks' labels mean for these kinds, e.g. "physical block id; allocate, free: sequence"."""
    blocks = [k for k in kinds if k not in LABEL_MEANING]
    by_meaning = {}
    for k in kinds:
        if k in LABEL_MEANING:
            by_meaning.setdefault(LABEL_MEANING[k], []).append(k)
    parts = (["physical block id"] if blocks else []) + [f"{', '.join(ks)}: {m}" for m, ks in by_meaning.items()]
    return "; ".join(parts)


def _check_phases(phases, num_events) -> list:
    phases = sorted((int(start), str(label)) for start, label in phases)
    if any(not 0 <= start <= num_events for start, _ in phases) or len({s for s, _ in phases}) != len(phases):
        raise InvalidArgumentError(f"phases must be (first event index, label) pairs with distinct starts in "
                                   f"0..{num_events}, got {phases!r}")
    return phases


def _draw_phases(ax, phases, num_events):
    """Alternate shading per phase, its label above the axes (staggered on two lines when phases are short)."""
    bounds = [start for start, _ in phases] + [num_events]
    for k, (start, label) in enumerate(phases):
        end = bounds[k + 1]
        if k % 2 == 0:
            ax.axvspan(start - 0.5, end - 0.5, color="#f0f0f0", zorder=0, gid=f"phase-{k}")
        ax.axvline(start - 0.5, color="#999999", lw=0.8, zorder=1)
        ax.annotate(label, ((start + end - 1) / 2, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(0, 3 + 11 * (k % 2)), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8, color="#333333", gid=f"phase-label-{k}")


def draw_timeline(source, ax=None, *, kinds=None, names=None, phases=None, max_marks: int = 300, bins: int = 100,
                  title=None):
    """Draw the event log of ``source`` (a recording BlockManager or a list of Events); returns the Axes.

    ``kinds`` picks and orders the rows (default: the kinds that occur). ``names`` maps sequence ids to the
    names marks use (default ``s<id>``). ``phases``: ``(first event index, label)`` pairs, e.g. recorded as
    ``(len(manager.events), "X freed")`` before each operation; each phase is shaded and captioned. Up to
    ``max_marks`` events are drawn one mark each (labelled while there are at most 80); more are counted in
    ``bins`` time bins."""
    events = events_of(source)
    if isinstance(max_marks, bool) or not isinstance(max_marks, int) or max_marks < 1:
        raise InvalidArgumentError(f"max_marks must be a positive int, got {max_marks!r}")
    phases = _check_phases(phases or (), len(events))
    rows = _kinds(events, kinds) or list(EVENT_KINDS)  # an empty log shows the empty rows
    row_of = {k: i for i, k in enumerate(rows)}
    shown = [(t, e) for t, e in enumerate(events) if e.kind in row_of]
    if ax is None:
        width = 11 if len(shown) > 30 else 8
        _, ax = plt.subplots(figsize=(width, 0.45 * len(rows) + 1.6 + (0.3 if phases else 0)))
    if len(shown) > max_marks:
        _draw_counts(ax, shown, row_of, len(events), bins)
    else:
        for kind in rows:
            xs = [t for t, e in shown if e.kind == kind]
            ax.scatter(xs, [row_of[kind]] * len(xs), s=60, marker="s", color=KIND_COLORS.get(kind, "#666666"),
                       gid=f"events-{kind}", zorder=2)
        if len(shown) <= 80:
            for k, (t, e) in enumerate(shown):  # alternate above/below so neighbours' labels do not overlap
                ax.annotate(event_label(e, names), (t, row_of[e.kind]), xytext=(0, 7 if k % 2 == 0 else -14),
                            textcoords="offset points", ha="center", fontsize=8, gid=f"event-{t}")
        ax.set_xlim(-1, max(len(events), 1))
        ax.grid(axis="x", alpha=0.3)
    if phases:
        _draw_phases(ax, phases, len(events))
    ax.set_yticks(range(len(rows)), rows, fontsize=9)
    ax.set_ylim(len(rows) - 0.4, -0.7)  # first kind on top
    ax.set_xlabel(f"event number (the order the manager recorded them)\nmark labels: {label_key(rows)}", fontsize=8)
    ax.set_title(title if title is not None else f"{len(events)} events", fontsize=10,
                 pad=30 if len(phases) > 1 else 16 if phases else 6)
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
