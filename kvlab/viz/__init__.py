"""Matplotlib pictures of a live BlockManager: tokens in logical blocks, the pool, the block tables, the
event timeline, a step-through of recorded snapshots, a serving engine's step timeline and its schedule;
plus what makes a notebook usable by a class: widgets that fall back to a static run when nobody is
watching (``explore``) and checks that explain instead of failing when a student turns a knob (``check``).

Every drawing takes a manager (plus the sequences whose tables to draw; the pool and the block tables also
a HybridBlockManager's, a row per group) or a recorded ``snapshot``, and an optional Axes; it returns the Axes
(``ax.figure`` is the Figure) and never calls ``plt.show()``.
"""

from kvlab.viz.checks import NotebookCheckError, check
from kvlab.viz.engine_timeline import draw_engine_timeline
from kvlab.viz.interactive import explore, is_interactive
from kvlab.viz.knobs import Stops
from kvlab.viz.pool import draw_block_tables, draw_pool
from kvlab.viz.schedule import SCHEDULE_STATES, draw_schedule
from kvlab.viz.snapshot import STATE_COLORS, STATE_NAMES, PoolView, TableView, snapshot
from kvlab.viz.timeline import EVENT_KINDS, draw_timeline, event_label
from kvlab.viz.tokens import draw_tokens
from kvlab.viz.widget import show_steps, snapshot_grid, step_widget

__all__ = ["draw_tokens", "draw_pool", "draw_block_tables", "draw_timeline", "snapshot", "snapshot_grid",
           "step_widget", "show_steps", "event_label", "PoolView", "TableView", "STATE_COLORS", "STATE_NAMES",
           "EVENT_KINDS", "draw_engine_timeline", "draw_schedule", "SCHEDULE_STATES", "explore", "is_interactive",
           "Stops", "check", "NotebookCheckError"]
