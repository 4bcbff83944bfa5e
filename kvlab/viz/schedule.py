"""Which request did what in every engine step: a Gantt chart of continuous batching.

``draw_schedule(frame)`` takes one row per (step, request) with the request's ``state`` in that step, as a
notebook records it around ``llm.step()``: one row of cells per request, one column per step, coloured by
state, so requests joining and leaving the batch, prefill steps that pause everybody's decoding, and
preemptions are visible at a glance. An optional boolean ``preempted`` column marks the step in which a
request lost its blocks.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from kvlab.errors import InvalidArgumentError

#: States in legend order, with their colours.
SCHEDULE_STATES = {"waiting": "#e4e4e4", "prefill": "#4e79a7", "recompute": "#9c6fb6", "decode": "#59a14f",
                   "paused": "#c7e3bf", "swapped": "#f28e2b"}
SCHEDULE_MEANING = {"waiting": "queued (not admitted yet)",
                    "prefill": "prefill: prompt computed (minus prefix hits)",
                    "recompute": "prefill again after a preemption by recompute",
                    "decode": "decode: one new token",
                    "paused": "running, but this step prefills others",
                    "swapped": "swapped out to CPU memory"}


def _check(frame):
    missing = [c for c in ("step", "request", "state") if c not in getattr(frame, "columns", ())]
    if missing:
        raise InvalidArgumentError(f"expected a DataFrame with step, request and state columns; missing {missing}")
    unknown = sorted(set(frame["state"]) - set(SCHEDULE_STATES))
    if unknown:
        raise InvalidArgumentError(f"unknown states {unknown}; known: {list(SCHEDULE_STATES)}")


def draw_schedule(frame, ax=None, *, title=None):
    """Draw ``frame`` (columns step, request, state, optionally preempted) as a Gantt chart; returns the Axes.
    Requests are rows in order of first appearance, steps are columns."""
    _check(frame)
    requests = list(dict.fromkeys(frame["request"]))
    row_of = {r: i for i, r in enumerate(requests)}
    steps = sorted(set(frame["step"]))
    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 3 + 0.28 * len(steps)), 0.38 * len(requests) + 1.6))
    for rec in frame.itertuples(index=False):
        y = row_of[rec.request]
        ax.add_patch(Rectangle((rec.step - 0.45, y - 0.4), 0.9, 0.8, facecolor=SCHEDULE_STATES[rec.state],
                               edgecolor="white", linewidth=0.5, gid=f"cell-{rec.request}-{rec.step}"))
    if "preempted" in frame:
        hit = frame[frame["preempted"].astype(bool)]
        ax.scatter(hit["step"], [row_of[r] for r in hit["request"]], marker="x", s=50, color="#d1495b",
                   linewidths=2, zorder=3, gid="preemptions", label="preempted in this step")
    ax.set_xlim(min(steps, default=0) - 0.6, max(steps, default=0) + 0.6)
    ax.set_ylim(len(requests) - 0.5, -0.5)
    ax.set_yticks(range(len(requests)), [str(r) for r in requests], fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("engine step", fontsize=9)
    ax.grid(axis="x", alpha=0.25)
    shown = [s for s in SCHEDULE_STATES if s in set(frame["state"])]
    meaning = dict(SCHEDULE_MEANING)
    if "recompute" in shown:  # only then can a waiting cell be a preempted request (a swapped one is "swapped")
        meaning["waiting"] = "queued (not admitted yet, or preempted by recompute)"
    handles = [Patch(facecolor=SCHEDULE_STATES[s], label=meaning[s]) for s in shown]
    if "preempted" in frame and frame["preempted"].any():
        handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title if title is not None else f"{len(requests)} requests over {len(steps)} steps", fontsize=10)
    return ax
