"""KV-cache memory a request holds when some layers use a sliding window (issue 16, section 3).

A hybrid model keeps full-attention K/V for some layers and only the last W tokens' K/V for the rest
(``kvlab.blocks.manager``). This study counts what that saves over the Mooncake conversation trace.

What "blocks held" counts: **pages per layer**, averaged over the model's layers. A page holds one layer's
K/V for ``block_size`` tokens; a full-attention layer holds every page of the sequence, a sliding-window layer
only the pages the manager keeps (``first_live_block``: pages wholly before ``q - W + 1`` are released, where
q is the step's first query position). For a mix of ``sliding : full`` layers the figure is
``(full * full_pages + sliding * window_pages) / (sliding + full)``, so all layers full gives the sequence's
page count, and the ratio of two mixes is the ratio of their KV memory (multiply by the layer count for
pages in the pool).

Workload, per request alone (no sharing, no preemption: this measures the footprint, not a schedule): the
prompt is scheduled in chunks of ``chunk`` tokens (None: the whole prompt in one step, so a window layer
holds every prompt page for that step), then one step per output token, until the request holds
``input + output`` tokens. After each step the request holds what ``HybridBlockManager`` keeps; per request
the study reports the **peak** over its steps and the **mean** over its steps, and over the trace the mean of
both and the largest peak. The counts are exact closed forms, checked step by step against a replay through
``HybridBlockManager`` in tests/studies/test_hybrid_memory.py.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from kvlab.studies.traces import check_frame, load_trace
from kvlab.validation import check_int, check_optional_int


@dataclass(frozen=True)
class LayerMix:
    """A model's layer kinds: ``sliding`` window layers of ``window`` tokens to ``full`` full-attention ones."""
    name: str
    sliding: int
    full: int
    window: Optional[int]


#: Gemma 3: five local (1024-token window) layers to one global. gpt-oss: alternating 128-token windows and
#: full attention. "All full" is the baseline every mix is compared with.
GEMMA3_LIKE = LayerMix("Gemma-3-like (5:1, W=1024)", 5, 1, 1024)
GPT_OSS_LIKE = LayerMix("gpt-oss-like (1:1, W=128)", 1, 1, 128)
ALL_FULL = LayerMix("all full", 0, 1, None)
MIXES = (ALL_FULL, GEMMA3_LIKE, GPT_OSS_LIKE)


def step_bounds(input_length: int, output_length: int, chunk: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """(first, end) positions each step schedules: the prompt's chunks, then one step per output token."""
    chunk = input_length if chunk is None else chunk
    prefill_starts = np.arange(0, input_length, chunk)
    starts = np.concatenate([prefill_starts, np.arange(input_length, input_length + output_length)])
    ends = np.concatenate([np.minimum(prefill_starts + chunk, input_length),
                           np.arange(input_length + 1, input_length + output_length + 1)])
    return starts, ends


def pages_held(starts: np.ndarray, ends: np.ndarray, block_size: int, window: Optional[int]) -> np.ndarray:
    """Pages one layer holds after each step: every page up to the step's end, less those released."""
    pages = -(-ends // block_size)
    if window is None:
        return pages
    return pages - np.maximum(0, starts - window + 1) // block_size


def mix_pages(starts, ends, block_size: int, mix: LayerMix) -> np.ndarray:
    """Pages per layer, averaged over the mix's layers, after each step."""
    full = pages_held(starts, ends, block_size, None)
    if not mix.sliding:
        return full.astype(float)
    window = pages_held(starts, ends, block_size, mix.window)
    return (mix.full * full + mix.sliding * window) / (mix.sliding + mix.full)


def request_footprints(trace: pd.DataFrame, block_size: int = 16, chunk: Optional[int] = None,
                       mixes=MIXES) -> pd.DataFrame:
    """One row per request and mix: ``peak`` and ``mean`` pages per layer over the request's steps."""
    trace = check_frame(trace, timestamps=False)
    check_int("block_size", block_size, 1)
    check_optional_int("chunk", chunk, 1)
    rows = []
    for i, (n_in, n_out) in enumerate(zip(trace["input_length"].to_numpy(), trace["output_length"].to_numpy())):
        starts, ends = step_bounds(int(n_in), int(n_out), chunk)
        for mix in mixes:
            held = mix_pages(starts, ends, block_size, mix)
            rows.append((i, mix.name, held.max(), held.mean()))
    return pd.DataFrame(rows, columns=["request", "mix", "peak", "mean"])


def summarize(footprints: pd.DataFrame) -> pd.DataFrame:
    """Per mix: the trace's mean of per-request peaks and means, the largest peak, and each as a share of
    all-full's (the memory the mix saves)."""
    table = footprints.groupby("mix", sort=False).agg(mean_peak=("peak", "mean"), mean_mean=("mean", "mean"),
                                                       max_peak=("peak", "max"))
    table = table.reindex([m for m in table.index if m == ALL_FULL.name] + [m for m in table.index
                                                                            if m != ALL_FULL.name])
    if ALL_FULL.name in table.index:
        for column in ["mean_peak", "mean_mean", "max_peak"]:
            table[f"{column}_vs_full"] = table[column] / table.loc[ALL_FULL.name, column]
    return table


def run(trace="mooncake_conversation", limit: Optional[int] = None, block_size: int = 16,
        chunk: Optional[int] = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-request footprints, summary) for a trace name, path or frame."""
    frame = trace if isinstance(trace, pd.DataFrame) else load_trace(trace, limit)
    footprints = request_footprints(frame, block_size, chunk)
    return footprints, summarize(footprints)


def plot(footprints: pd.DataFrame, ax=None, stat: str = "mean"):
    """Per-request pages per layer (``stat``: peak or mean), sorted, one line per mix, log scale."""
    import matplotlib.pyplot as plt

    if ax is None:
        ax = plt.subplots(figsize=(7, 4))[1]
    for mix, group in footprints.groupby("mix", sort=False):
        values = np.sort(group[stat].to_numpy())
        ax.plot(np.arange(1, len(values) + 1) / len(values), values, label=mix)
    ax.set_yscale("log")
    ax.set_xlabel("share of requests (sorted by footprint)")
    ax.set_ylabel(f"{stat} pages per layer per request")
    ax.legend()
    return ax
