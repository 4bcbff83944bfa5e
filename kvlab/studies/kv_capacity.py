"""What a smaller KV cache buys: the Mooncake conversation trace's prefix-cache hit rate when one fixed memory
budget holds the blocks of each KV cache format (issue 26 §2).

The budget is the KV memory of Llama-3-8B (32 layers, 8 KV heads of 128) on an 80 GB GPU, ``BUDGET_BYTES``
(48 GiB: 80 GB x 0.9 less ~16 GB of bf16 weights and the activations, rounded down). Each format's bytes per
token (``kvlab.sizing``, the engine's own figures) set how many 512-token blocks (Mooncake's native block)
fit; the trace is replayed once per pool size through the real ``BlockManager`` (``kvlab.studies``, LRU,
sequential), so the only change between rows is the number of blocks. Rows "4x" and "8x" are the ideal 4-bit
and 2-bit caches (no scales), to show where the curve goes.

KIVI (``kivi_int4``, ``kivi_int2``, G = 32) keeps each running sequence's newest tokens, up to R = 128, in
bf16 beside the pages (``kvlab.kernels.torch_paged_quant.ResidualWindow``): that memory is taken from the
budget first, for ``WINDOW_SEQUENCES`` sequences (vLLM's default ``max_num_seqs``), before the pages are
counted (``window_bytes``).

``python -m kvlab.studies.kv_capacity [--out data/kv_quant]`` writes ``mooncake_kv_capacity.csv``.
"""

import argparse
import sys
from pathlib import Path

import pandas as pd

from kvlab.sizing import KVLayout
from kvlab.studies.study import cache_hit_study

BUDGET_BYTES = 48 << 30
BLOCK_TOKENS = 512
LLAMA3_8B = dict(num_kv_heads=8, head_dim=128, layer_windows=(None,) * 32)
BF16 = KVLayout(dtype="bfloat16", **LLAMA3_8B).bytes_per_token
#: KIVI's full-precision window: R tokens of bf16 K/V for each of this many running sequences.
KIVI_RESIDUAL = 128
WINDOW_SEQUENCES = 256
KIVI = ("kivi_int4", "kivi_int2")


def formats() -> list[tuple[str, int, int]]:
    """(label, bytes per token, bytes kept outside the pages) of each pool compared: the engine's formats
    (KIVI with its windows), then ideal 4- and 2-bit caches."""
    rows = [(name, KVLayout(dtype=name, **LLAMA3_8B).bytes_per_token,
             WINDOW_SEQUENCES * KIVI_RESIDUAL * BF16 if name in KIVI else 0)
            for name in ("bfloat16", "k_fp16_v_fp8", "fp8", "int4_calibrated_channel", *KIVI)]
    return rows + [("ideal 4-bit (4x)", BF16 // 4, 0), ("ideal 2-bit (8x)", BF16 // 8, 0)]


def run_study(budget_bytes: int = BUDGET_BYTES, limit: int | None = None):
    pools = [(label, per_token, window, (budget_bytes - window) // (per_token * BLOCK_TOKENS))
             for label, per_token, window in formats()]
    hits = cache_hit_study(["mooncake_conversation"], block_sizes=[BLOCK_TOKENS], capacities=[p[3] for p in pools],
                           policies=["lru"], limit=limit, progress=False)
    by_capacity = hits.set_index("capacity_blocks")
    rows = []
    for label, per_token, window, blocks in pools:
        hit = by_capacity.loc[blocks]
        rows.append(dict(format=label, bytes_per_token=per_token, window_bytes=window,
                         blocks_vs_bf16=round(blocks / pools[0][3], 3), pool_blocks=blocks,
                         pool_tokens=blocks * BLOCK_TOKENS,
                         hit_rate_tokens=round(float(hit["hit_rate_tokens"]), 4),
                         ceiling_hit_rate_tokens=round(float(hit["ceiling_hit_rate_tokens"]), 4),
                         requests=int(hit["requests"]), requests_skipped=int(hit["requests_skipped"])))
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.studies.kv_capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=BUDGET_BYTES / 2**30,
                        help="KV memory in GiB (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--out", default="data/kv_quant", help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    table = run_study(int(args.budget_gib * 2**30), args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "mooncake_kv_capacity.csv", index=False)
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
