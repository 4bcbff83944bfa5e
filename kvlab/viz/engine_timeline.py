"""A serving engine's steps as a timeline: what each step computed, how full the pool was, and what the
block manager had to do (prefix hits, preemptions, swaps, copy-on-write).

``draw_engine_timeline(llm_or_dataframe)`` reads ``kvlab.engine.LLM.step_dataframe()`` (one row per step).
Four panels share the x axis, which is wall-clock time by default, so a step's width is what it cost: a
prefill that hit the prefix cache is visibly narrower than one that did not.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from kvlab.errors import InvalidArgumentError

STEP_COLUMNS = ("step", "kind", "start_s", "wall_s", "num_seqs", "num_tokens", "cached_tokens", "blocks_used",
                "blocks_free", "blocks_cached", "preempted", "blocks_swapped_out", "blocks_swapped_in",
                "cow_copies", "waiting", "running", "swapped")
KIND_COLORS = {"prefill": "#4e79a7", "decode": "#59a14f", "mixed": "#76b7b2", "idle": "#bab0ac"}
KIND_LABELS = {"prefill": "prefill: computed", "decode": "decode: one per sequence",
               "mixed": "mixed: prompt chunks\nand decodes (V1)", "idle": "idle: only aborts"}
HIT_COLOR = "#edc948"


def _steps(source):
    frame = source.step_dataframe() if hasattr(source, "step_dataframe") else source
    missing = [c for c in STEP_COLUMNS if c not in getattr(frame, "columns", ())]
    if missing:
        raise InvalidArgumentError(f"expected an LLM or its step_dataframe(); missing columns {missing}")
    return frame


def draw_engine_timeline(source, axes=None, *, x: str = "time", title=None):
    """Draw the steps of ``source`` (a ``kvlab.engine.LLM`` or its ``step_dataframe()``); returns the four
    Axes (``axes[0].figure`` is the Figure). ``x``: "time" (bars as wide as the step took) or "step"."""
    frame = _steps(source)
    if x not in ("time", "step"):
        raise InvalidArgumentError(f"x must be 'time' or 'step', got {x!r}")
    if axes is None:
        _, axes = plt.subplots(4, 1, figsize=(11, 8), sharex=True, layout="constrained",
                               gridspec_kw=dict(height_ratios=[2, 2, 1.2, 1.2]))
    elif len(axes) != 4:
        raise InvalidArgumentError(f"axes must be 4 Axes (tokens, pool, block work, queues), got {len(axes)}")
    if x == "time":
        left, width = frame["start_s"].to_numpy(), frame["wall_s"].to_numpy()
        label = "time since the engine started (s); each bar spans one step"
    else:
        left, width = frame["step"].to_numpy() - 0.4, np.full(len(frame), 0.8)
        label = "step"
    tokens, pool, work, queues = axes
    legend = dict(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))

    colors = [KIND_COLORS.get(k, "#666666") for k in frame["kind"]]
    tokens.bar(left, frame["num_tokens"], width, align="edge", color=colors, edgecolor="white", linewidth=0.5,
               gid="tokens-computed")
    tokens.bar(left, frame["cached_tokens"], width, bottom=frame["num_tokens"], align="edge", color=HIT_COLOR,
               hatch="//", edgecolor="white", linewidth=0, gid="tokens-cached")
    tokens.set_ylabel("tokens", fontsize=8)
    ran = set(frame["kind"])  # the legend names only what this run did: no "mixed" in a V0 run
    kinds = [Patch(color=KIND_COLORS[kind], label=label) for kind, label in KIND_LABELS.items() if kind in ran]
    hits = [Patch(facecolor=HIT_COLOR, hatch="//", label="prefix hit: read,\nnot computed")]
    tokens.legend(handles=kinds + (hits if frame["cached_tokens"].any() else []), **legend)

    pool.bar(left, frame["blocks_used"], width, align="edge", color="#4e79a7", edgecolor="white", linewidth=0.5,
             label="in use", gid="pool-used")
    pool.bar(left, frame["blocks_free"], width, bottom=frame["blocks_used"], align="edge", color="#d3d3d3",
             label="free", gid="pool-free")
    pool.hlines(frame["blocks_cached"], left, left + width, color="#e15759", linewidth=2, label="cached (hittable)")
    pool.set_ylabel("blocks", fontsize=8)
    pool.legend(**legend)

    # Block work: one thin bar per kind inside each step's span.
    series = (("preempted", "sequences preempted", "#e15759"), ("blocks_swapped_out", "blocks swapped out", "#f28e2b"),
              ("blocks_swapped_in", "blocks swapped in", "#59a89c"), ("cow_copies", "copy-on-write copies", "#b07aa1"))
    for i, (column, name, color) in enumerate(series):
        work.bar(left + width * i / len(series), frame[column], width / len(series), align="edge", color=color,
                 label=name if frame[column].any() else "_nolegend_", gid=f"work-{column}")
    work.set_ylim(0, max(1, int(frame[[c for c, _, _ in series]].to_numpy().max())) * 1.15)
    work.yaxis.get_major_locator().set_params(integer=True)
    work.set_ylabel("count", fontsize=8)
    if frame[[c for c, _, _ in series]].to_numpy().any():  # named only where it happened
        work.legend(**legend)

    for column, color in (("waiting", "#bab0ac"), ("running", "#59a14f"), ("swapped", "#f28e2b")):
        queues.hlines(frame[column], left, left + width, color=color, linewidth=2, label=column)
    queues.yaxis.get_major_locator().set_params(integer=True)
    queues.set_ylabel("sequences", fontsize=8)
    queues.set_xlabel(label, fontsize=8)
    queues.legend(**legend)
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    tokens.set_title(title if title is not None else f"{len(frame)} engine steps", fontsize=10)
    return axes
