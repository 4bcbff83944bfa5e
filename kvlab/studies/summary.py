"""The few sentences ``kvlab study`` prints under its table: the ceiling, then per capacity how close the
policies get and how many requests the pool could not serve.

Policies that tie are said to tie, not one of them named best (with a pool too small to keep anything
between requests every policy hits the same blocks). A hit rate counts a skipped request's prompt as all
misses (``kvlab.studies.simulator``), so the requests skipped (a prompt larger than the pool) and those
dropped mid-decode (overlap mode: a sequence that outgrew the whole pool) are said beside it: they are part
of why it is low. The hit-rate doctor's columns (kvlab.studies.doctor), where the rows have them, add the
best row's main causes of misses.
"""

import math

import pandas as pd

from kvlab.studies.doctor import CAUSES, HITS
from kvlab.studies.tiers import tier_label

TIER_KEYS = ["offload_capacity_blocks", "offload_policy", "offload_admission"]


def summary(table: pd.DataFrame) -> str:
    lines = []
    for (trace, block_size), group in table.groupby(["trace", "block_size"], sort=False):
        ceiling = group["ceiling_hit_rate_tokens"].iloc[0]
        lines.append(f"{trace}, block size {block_size}: an infinite cache would serve {ceiling:.1%} of prompt "
                     "tokens from cache.")
        finite = group[group["capacity_blocks"] != math.inf]
        # With an offload tier (kvlab.studies.tiers), each tier is its own line: policies compare behind one tier.
        tiers = [c for c in TIER_KEYS if c in finite]
        for key, at_capacity in finite.groupby(["capacity_blocks", *tiers], sort=False):
            capacity, *tier = key if isinstance(key, tuple) else (key,)
            lines.append(f"  {int(capacity):>9,} blocks{tier_label(*tier) if tier else ''}: "
                         f"{_policies(at_capacity, ceiling)}{_unserved(at_capacity)}{_causes(at_capacity)}")
    return "\n".join(lines)


def _policies(rows: pd.DataFrame, ceiling: float) -> str:
    best = rows["hit_rate_tokens"].max()
    rate = f"{best:.1%}" + (f" ({best / ceiling:.0%} of the ceiling)" if ceiling else "")
    winners = rows.loc[rows["hit_rate_tokens"] == best, "policy"].tolist()
    if len(rows) == 1:
        return f"{winners[0]} hits {rate}"
    if len(winners) == len(rows):
        return f"all policies tie at {rate}"
    if len(winners) == 1:
        return f"best policy {winners[0]} hits {rate}"
    return f"best policies {' and '.join(winners)} tie at {rate}"


def _unserved(rows: pd.DataFrame) -> str:
    """``; N of M requests skipped ...``: the same for every policy (it depends on the pool only); drops
    mid-decode can differ by policy, so the most is said."""
    total = int((rows["requests"] + rows["requests_skipped"] + rows["requests_dropped_mid_decode"]).iloc[0])
    skipped, dropped = int(rows["requests_skipped"].max()), int(rows["requests_dropped_mid_decode"].max())
    said = f"; {skipped:,} of {total:,} requests skipped (prompt larger than the pool)" if skipped else ""
    if dropped:
        varies = rows["requests_dropped_mid_decode"].nunique() > 1
        said += f"; {'up to ' if varies else ''}{dropped:,} of {total:,} dropped mid-decode (outgrew the pool)"
    return said


def _causes(rows: pd.DataFrame, most: int = 3) -> str:
    """``; misses: 68.0% cold, 27.9% evicted (reuse distance p50: 332 admissions)``: the best row's largest miss
    causes, as shares of the tokens admitted; nothing for rows without the doctor's columns."""
    columns = [f"{cause}_tokens" for cause in CAUSES]
    if not set(columns) <= set(rows.columns):
        return ""
    best = rows.loc[rows["hit_rate_tokens"].idxmax()]
    total = sum(best[c] for c in columns)
    misses = sorted(((best[f"{c}_tokens"], c) for c in CAUSES if c not in HITS and best[f"{c}_tokens"]), reverse=True)
    if not total or not misses:
        return ""
    said = ", ".join(f"{tokens / total:.1%} {cause.replace('_', ' ')}" for tokens, cause in misses[:most])
    distance = best.get("evicted_reuse_distance_p50")
    if any(cause == "evicted" for _, cause in misses[:most]) and distance is not None and not pd.isna(distance):
        said += f" (reuse distance p50: {distance:,.0f} admissions)"
    return f"; misses: {said}"
