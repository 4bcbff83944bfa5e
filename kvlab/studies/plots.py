"""Figures for the studies: hit rate versus capacity per policy, memory-waste stacked bars, and the hit-rate
doctor's causes stacked."""

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvlab.studies.doctor import CAUSES
from kvlab.studies.memory_waste import SHARES
from kvlab.studies.tiers import tier_label

#: The doctor's causes (kvlab.studies.doctor): hits green, misses by cause.
CAUSE_COLORS = {"hit_gpu": "#4c956c", "hit_tier": "#8cd17d", "cold": "#bab0ac", "evicted": "#e15759",
                "partial_block": "#f2c14e", "group_cut": "#b07aa1", "speculative_drop": "#76b7b2",
                "isolated": "#9c755f", "recompute": "#f28e2b", "tier_miss": "#ff9da7", "not_admitted": "#79706e"}
SHARE_COLORS = {"token_states": "#4c956c", "reservation": "#f2c14e",
                "internal_fragmentation": "#f78154", "external_fragmentation": "#b0b0b0"}


def plot_hit_rates(table: pd.DataFrame, x: str = "capacity_blocks"):
    """One panel per trace x block size: token hit rate versus capacity (log scale), a line per policy (and
    offload tier, if any), and the infinite-cache ceiling dashed. Returns the figure."""
    panels = list(table.groupby(["trace", "block_size"], sort=False))
    columns = min(len(panels), 3)
    rows_needed = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_needed, columns, figsize=(5.5 * columns, 4 * rows_needed), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, ((trace, block_size), group) in zip(axes.flat, panels):
        finite = group[group["capacity_blocks"] != math.inf]
        tiers = [c for c in ("offload_capacity_blocks", "offload_policy", "offload_admission") if c in finite]
        for key, rows in finite.groupby(["policy", *tiers], sort=False):
            policy, *tier = key if isinstance(key, tuple) else (key,)
            rows = rows.sort_values(x)
            ax.plot(rows[x], 100 * rows["hit_rate_tokens"], marker="o",
                    label=policy + (tier_label(*tier) if tier else ""))
        ceiling = 100 * group["ceiling_hit_rate_tokens"].iloc[0]
        ax.axhline(ceiling, color="k", linestyle="--", linewidth=1, label=f"infinite cache ({ceiling:.1f}%)")
        if len(finite):
            ax.set_xscale("log")
            ticks = np.unique(finite[x].to_numpy())  # label the capacities measured, not powers of ten
            ax.set_xticks(ticks, [f"{int(t):,}" for t in ticks], rotation=30 if len(ticks) > 4 else 0)
            ax.minorticks_off()
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel("prompt tokens served from cache (%)")
        ax.set_ylim(0, max(5.0, ceiling * 1.15))
        ax.set_title(f"{trace}, block size {block_size}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_memory_waste(table: pd.DataFrame, ax=None):
    """Stacked bars of the four memory shares per scheme (like the vLLM paper's Figure 2), with the
    paper's published token-state share marked where it has one. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    positions = np.arange(len(table))
    bottom = np.zeros(len(table))
    for share in SHARES:
        values = 100 * table[share].to_numpy()
        ax.bar(positions, values, bottom=bottom, color=SHARE_COLORS[share], label=share.replace("_", " "))
        bottom += values
    labelled = False
    for i, (tokens, paper) in enumerate(zip(table["token_states"], table["paper_token_states"])):
        ax.text(i, 2, f"{100 * tokens:.1f}%", ha="center", va="bottom", fontsize=8)
        if not math.isnan(paper):
            ax.plot([i - 0.4, i + 0.4], [100 * paper] * 2, color="k", linewidth=2,
                    label=None if labelled else "paper's token states (Fig. 2)")
            labelled = True
    ax.set_xticks(positions, table["scheme"])
    ax.set_ylabel("share of the KV memory budget (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_miss_causes(rows: pd.DataFrame, x: str, ax=None, labels=None):
    """Stacked bars, one per row of a study's ``rows`` (in their order): the share of the prompt tokens each
    cause of ``kvlab.studies.doctor.CAUSES`` took (the causes a row has none of are left out of the legend);
    ``x`` names the bars' column, ``labels`` overrides their text. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    positions = np.arange(len(rows))
    total = rows[[f"{cause}_tokens" for cause in CAUSES]].sum(axis=1).to_numpy(np.float64)
    bottom = np.zeros(len(rows))
    for cause in CAUSES:
        values = 100 * rows[f"{cause}_tokens"].to_numpy(np.float64) / total
        if values.any():
            ax.bar(positions, values, bottom=bottom, color=CAUSE_COLORS[cause], label=cause.replace("_", " "))
            bottom += values
    ax.set_xticks(positions, labels if labels is not None else [
        "inf" if value == math.inf else f"{int(value):,}" for value in rows[x]])
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel("share of the tokens admitted (%)")  # the prompts, and any recomputation's tokens
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
